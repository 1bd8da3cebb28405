#!/usr/bin/env bash
# Generate the Python protobuf/gRPC modules of proto/*.proto into ccprofd/export/gen/ (gitignored).
# Idempotent and fast: regenerates only when a .proto file or the grpcio-tools version changed.
# The proto files are mapped to the virtual path ccprofd/export/gen/ so the generated modules import
# each other as `ccprofd.export.gen.X_pb2` (protoc otherwise writes top-level imports).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OUT=ccprofd/export/gen
STAMP=$OUT/.stamp
TOOLS=$("$PY" -c 'import grpc_tools, importlib.metadata as m; print(m.version("grpcio-tools"))')
WANT=$( { echo "$TOOLS"; cat proto/*.proto; } | sha256sum | cut -d' ' -f1)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
  exit 0
fi
mkdir -p "$OUT"
rm -f "$OUT"/*_pb2*.py "$OUT"/*_pb2*.pyi
touch "$OUT/__init__.py"
"$PY" -m grpc_tools.protoc --proto_path="$OUT=proto" \
  --python_out=. --pyi_out=. --grpc_python_out=. \
  "$OUT/ccprofd.proto" "$OUT/profile.proto"
echo "$WANT" > "$STAMP"
echo "gen_proto: generated $(ls "$OUT"/*_pb2*.py | wc -l) modules in $OUT" >&2
