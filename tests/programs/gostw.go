// gostw: a Go program for tests/test_unwind_go.py's thread-snapshot test.  main calls runtime.GC
// while another goroutine spins in a loop without preemption points: with GODEBUG=asyncpreemptoff=1
// nothing can stop it, so the GC's stop-the-world waits on the main thread's g0 stack, under
// runtime.systemstack, until the spin ends (a second or two).  It prints "gc" just before.
package main

import (
	"os"
	"runtime"
	"time"
)

var sink int

//go:noinline
func spin(n int) int {
	s := 0
	for i := 0; i < n; i++ {
		s += i ^ (s >> 3)
	}
	return s
}

func main() {
	runtime.GOMAXPROCS(2)
	done := make(chan int)
	go func() { done <- spin(3_000_000_000) }()
	time.Sleep(50 * time.Millisecond)
	os.Stdout.Write([]byte("gc\n"))
	runtime.GC()
	sink = <-done
	os.Stdout.Write([]byte("gostw: done\n"))
}
