// gotime: a Go program for tests/test_unwind_go.py's vDSO test.  Two goroutines read the clock in
// a loop (time.Now: Go's time.now, which moves to the thread's g0 stack and calls the vDSO's
// clock_gettime, after recording where it was called from in m.vdsoPC and m.vdsoSP), so most CPU
// samples land in the vDSO under time.now.  argv[1]: clock reads per goroutine (default 3000000).
// It prints "gotime: done" at the end.
package main

import (
	"os"
	"strconv"
	"sync"
	"time"
)

var sink [2]int64

//go:noinline
func readClock(n int, slot int, wg *sync.WaitGroup) {
	defer wg.Done()
	var s int64
	for i := 0; i < n; i++ {
		s += time.Now().UnixNano() & 1
	}
	sink[slot] = s
}

func main() {
	n := 3000000
	if len(os.Args) > 1 {
		n, _ = strconv.Atoi(os.Args[1])
	}
	var wg sync.WaitGroup
	for i := 0; i < 2; i++ {
		wg.Add(1)
		go readClock(n, i, &wg)
	}
	wg.Wait()
	os.Stdout.Write([]byte("gotime: done\n"))
}
