package main

import (
	"fmt"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
)

// placeSpawnerAndSayWhere: a child's part in the test below. Started from the
// main goroutine, as main() starts it, the spawner takes a placement (a pipe
// stands in for a cgroup's tasks file) and the child prints whether the
// spawner's thread is the process's main thread.
func placeSpawnerAndSayWhere() {
	startSpawner()
	var p [2]int
	if err := syscall.Pipe(p[:]); err != nil {
		panic(err)
	}
	reply := make(chan spawnReply, 1)
	spawns <- spawnRequest{tasks: []int{p[1]}, reply: reply}
	r := <-reply
	fmt.Printf("spawner=%d main=%d err=%v\n", r.pid, os.Getpid(), r.err)
	os.Exit(0)
}

// The spawner is never the agent's main thread. cgroup v1 charges a
// process's memory to the cgroup of its main thread and shows that thread's
// cgroups in /proc/PID/cgroup: a spawner there would put the whole agent's
// memory into the workload's cgroup (within reach of its OOM killer) and say
// the agent runs there. Go may run any goroutine on the main thread once the
// main goroutine blocks, unless main holds it (CI once saw the agent's pid
// in the workload's cpu cgroup).
func TestTheSpawnerIsNeverTheMainThread(t *testing.T) {
	me, _ := os.Executable()
	for i := 0; i < 20; i++ {
		child := exec.Command(me)
		child.Env = append(os.Environ(), "HUTCH_AGENT_TEST_SPAWNER=1")
		out, err := child.Output()
		if err != nil {
			t.Fatal(err)
		}
		var spawner, main int
		var placed string
		if _, err := fmt.Sscanf(string(out), "spawner=%d main=%d err=%s", &spawner, &main, &placed); err != nil {
			t.Fatalf("%q: %v", out, err)
		}
		if strings.TrimSpace(placed) != "<nil>" {
			t.Fatalf("the placement failed: %s", out)
		}
		if spawner == main || spawner == 0 {
			t.Fatalf("run %d: the spawner is thread %d of process %d", i, spawner, main)
		}
	}
}
