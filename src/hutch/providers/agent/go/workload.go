package main

// The workload's cgroup: what the agent runs is held to the sandbox's limits
// in a cgroup of its own, below the sandbox's, while the agent keeps a small
// reserve above it. A fork bomb or a memory hog then fills the workload's
// cgroup, never the room the agent needs to answer (Go's threads count as
// tasks too). The workload's cpu cgroup weighs as one against the agent's
// threads, however many processes it runs, so that busy loops never leave the
// agent a sliver of the CPU; the sandbox's CPU limit, above, bounds both.
//
// cgroup v1 places threads, not only processes, and a child starts in the
// cgroups of the thread that forked it. So one OS thread of the agent, the
// spawner, is moved into the workload's cgroups and every command is forked
// from it: no command runs outside them, not for an instant, and the
// agent's other threads stay where they are. The host opens the workload
// cgroups' `tasks` files (the sandbox cannot: its cgroup file system is
// read-only) and hands the descriptors over; the spawner writes "0" (itself)
// into each and closes them at once, so nothing in the sandbox can reach
// them afterwards.

import (
	"runtime"
	"strings"
	"syscall"
)

type spawnRequest struct {
	path  string
	argv  []string
	attr  *syscall.ProcAttr
	tasks []int // a placement: move the spawner into these cgroups' tasks
	reply chan spawnReply
}

type spawnReply struct {
	pid int
	err error
}

var spawns = make(chan spawnRequest)

// workloadOOM: where the workload's memory cgroup counts its OOM kills, as
// the agent sees it ("" until the host placed the spawner).
var workloadOOM string

func startSpawner() {
	go func() {
		runtime.LockOSThread() // never unlocked: this thread is the spawner for good
		for req := range spawns {
			if req.tasks != nil {
				var failed error
				for _, fd := range req.tasks {
					if _, err := syscall.Write(fd, []byte("0")); err != nil && failed == nil {
						failed = err
					}
					syscall.Close(fd)
				}
				// pid: the spawner's thread, for a test to see where it is.
				req.reply <- spawnReply{pid: syscall.Gettid(), err: failed}
				continue
			}
			pid, err := syscall.ForkExec(req.path, req.argv, req.attr)
			req.reply <- spawnReply{pid: pid, err: err}
		}
	}()
}

// forkExec runs on the spawner's thread.
func forkExec(path string, argv []string, attr *syscall.ProcAttr) (int, error) {
	reply := make(chan spawnReply, 1)
	spawns <- spawnRequest{path: path, argv: argv, attr: attr, reply: reply}
	r := <-reply
	return r.pid, r.err
}

// handleWorkload: the host's descriptors of the workload's `tasks` files
// (pids, memory and cpu), and the workload cgroup's name for reading its OOM count.
func handleWorkload(c *conn, h header) error {
	fds := c.takeFds()
	name := str(h, "name")
	if len(fds) == 0 || len(fds) > maxFds || strings.ContainsAny(name, "/\x00") || name == ".." {
		for _, fd := range fds {
			syscall.Close(fd)
		}
		return c.fail("invalid_argument", "a workload placement needs its cgroups' tasks files")
	}
	reply := make(chan spawnReply, 1)
	spawns <- spawnRequest{tasks: fds, reply: reply}
	if r := <-reply; r.err != nil {
		return c.fail("provider_error", "cannot enter the workload's cgroup: "+r.err.Error())
	}
	reapMu.Lock()
	if name != "" {
		workloadOOM = "/sys/fs/cgroup/memory/" + name + "/memory.oom_control"
	}
	reapMu.Unlock()
	return c.send(header{"t": "ok"}, nil)
}
