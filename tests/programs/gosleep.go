// gosleep: a Go program for tests/test_unwind_go.py's scheduler test.  The main goroutine is locked
// to the main thread and sleeps five times.  Each sleep parks it (gopark > mcall(park_m)), and the
// thread, which may run no other goroutine, waits in the scheduler on its g0 stack:
//   mcall > park_m > schedule > stoplockedm > mPark > notesleep > futexsleep > futex.
package main

import (
	"os"
	"runtime"
	"time"
)

func init() { runtime.LockOSThread() }

func main() {
	for i := 0; i < 5; i++ {
		time.Sleep(2 * time.Millisecond)
	}
	os.Stdout.Write([]byte("gosleep: done\n"))
}
