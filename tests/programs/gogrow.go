// gogrow: a Go program for tests/test_unwind_go.py's morestack test.  Goroutines recurse deeply
// through functions with large frames, so their stacks grow again and again: each growth is a call
// of runtime.morestack from a function's prologue, which calls newstack on the thread's g0 stack,
// where copystack copies the stack and walks every frame of it (adjustframe) -- much of the
// program's CPU time.  argv[1]: rounds per worker (default 1500).  It prints "gogrow: done" at the end.
package main

import (
	"os"
	"strconv"
	"sync"
)

var sink [4]int

//go:noinline
func deep(n int) int {
	var pad [512]byte // a large frame: the stack grows every few calls
	pad[n%512] = byte(n)
	if n == 0 {
		return int(pad[0])
	}
	return deep(n-1) + int(pad[(n*7)%512])
}

//go:noinline
func worker(rounds int, wg *sync.WaitGroup, slot int) {
	defer wg.Done()
	s := 0
	for i := 0; i < rounds; i++ {
		done := make(chan int)
		go func() { done <- deep(3000) }() // a fresh goroutine: a small stack, grown from the start
		s += <-done
	}
	sink[slot] = s
}

func main() {
	rounds := 1500
	if len(os.Args) > 1 {
		rounds, _ = strconv.Atoi(os.Args[1])
	}
	var wg sync.WaitGroup
	for i := 0; i < 2; i++ {
		wg.Add(1)
		go worker(rounds, &wg, i)
	}
	wg.Wait()
	os.Stdout.Write([]byte("gogrow: done\n"))
}
