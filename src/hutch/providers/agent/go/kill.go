package main

import (
	"bytes"
	"fmt"
	"os"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// -- kill -------------------------------------------------------------------------

// carries: whether process pid's environment holds needle (NAME=value\0).
func carries(pid int, needle []byte) bool {
	data, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/environ")
	if err != nil {
		return false
	}
	return bytes.HasPrefix(data, needle) || bytes.Contains(data, append([]byte{0}, needle...))
}

// procStat: what /proc/PID/stat says of a process that a kill needs: its
// state, process group and start time (a reused pid has another).
type procStat struct {
	state byte
	group int
	start uint64
}

func readStat(pid int) (procStat, bool) {
	data, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return procStat{}, false
	}
	end := bytes.LastIndexByte(data, ')')
	if end < 0 || end+2 >= len(data) {
		return procStat{}, false
	}
	fields := strings.Fields(string(data[end+2:]))
	if len(fields) < 20 {
		return procStat{}, false
	}
	group, _ := strconv.Atoi(fields[2])
	start, _ := strconv.ParseUint(fields[19], 10, 64)
	return procStat{fields[0][0], group, start}, true
}

// processTree: one command's processes, its process group (pid) and every
// process carrying its marker, wherever it went (another group, another
// session); each one seen is remembered, to wait until it is reaped. The
// group is the command's only while a process known to be the command's
// still has it (a member keeps the group's number taken): once the group is
// gone its number is free, and a later command whose group takes it is no
// member, nor is it signalled.
type processTree struct {
	pid    int
	needle []byte
	seen   map[int]uint64
	// leaderHeld: whether the group's leader (pid) is this agent's child,
	// not reaped yet (see unreapedChild).
	leaderHeld func(pid int) bool
	// groupHeld: whether the last look found the group still the command's.
	groupHeld bool
}

// looked: a process seen by a look, and whether it is certainly the
// command's (seen before with this start, or carrying the marker).
type looked struct {
	pid   int
	st    procStat
	known bool
}

// alive: the tree's processes alive now (zombies are not).
func (t *processTree) alive() []int {
	entries, _ := os.ReadDir("/proc")
	self := os.Getpid()
	var all []looked
	// Its leader unreaped, the group is the command's (a session leader,
	// as each command is, cannot leave its group).
	t.groupHeld = t.pid > 0 && t.leaderHeld != nil && t.leaderHeld(t.pid)
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid == self || pid == 1 {
			continue
		}
		st, ok := readStat(pid)
		if !ok {
			continue
		}
		start, seen := t.seen[pid]
		known := (seen && start == st.start) || (t.needle != nil && carries(pid, t.needle))
		if known && t.pid > 0 && st.group == t.pid {
			t.groupHeld = true
		}
		all = append(all, looked{pid, st, known})
	}
	var pids []int
	for _, l := range all {
		if l.known || (t.groupHeld && l.st.group == t.pid) {
			if _, ok := t.seen[l.pid]; !ok {
				t.seen[l.pid] = l.st.start
			}
			if l.st.state != 'Z' && l.st.state != 'X' {
				pids = append(pids, l.pid)
			}
		}
	}
	return pids
}

// signal: sig to the command's process group while it is the command's
// (the kernel lets no member fork past a group's signal: a fork bomb's
// generation in flight is caught with it, however starved of CPU this
// agent is), then to each process of the tree alive, those that left the
// group among them; how many the look found alive. The group is signalled
// just after a look found it held by a process of the command's: its number
// cannot be taken again before the whole pid space has been gone round.
func (t *processTree) signal(sig syscall.Signal) int {
	found := t.alive()
	if t.pid > 0 && t.groupHeld {
		_ = syscall.Kill(-t.pid, sig)
	}
	n := 0
	for _, p := range found {
		if syscall.Kill(p, sig) == nil {
			n++
		}
	}
	return n
}

// unreaped: the processes seen that still hold their pid (alive, or zombies
// their parent or this agent has not reaped yet).
func (t *processTree) unreaped() []int {
	var left []int
	for pid, start := range t.seen {
		if st, ok := readStat(pid); ok && st.start == start {
			left = append(left, pid)
		}
	}
	return left
}

// reapBound: how long a kill waits, past its grace, for its SIGKILLed
// processes to be gone and reaped: they go at once unless the kernel holds them.
const reapBound = 10 * time.Second

// until: look at done every step until it says so or deadline passes.
func until(done func() bool, deadline time.Time, step time.Duration) {
	for !done() && time.Now().Before(deadline) {
		time.Sleep(step)
	}
}

// killTree: SIGTERM to the command's process group and every process marked
// as its own, grace for them to go, then SIGKILL rounds until none is alive
// (what forked between a look and its kill, a fork bomb's, the next finds),
// then a wait until each one seen is reaped: a zombie holds its pid, which
// the sandbox's pids limit counts. It answers once the tree is gone, or
// after reapBound with how many processes are still there.
func killTree(pid int, marker string, grace time.Duration) []int {
	t := &processTree{pid: pid, seen: map[int]uint64{}, leaderHeld: unreapedChild}
	if marker != "" {
		t.needle = append([]byte(marker), 0)
	}
	if t.signal(syscall.SIGTERM) > 0 {
		until(func() bool { return len(t.alive()) == 0 }, time.Now().Add(grace), 20*time.Millisecond)
	}
	deadline := time.Now().Add(reapBound)
	until(func() bool { return t.signal(syscall.SIGKILL) == 0 }, deadline, 5*time.Millisecond)
	until(func() bool { return len(t.unreaped()) == 0 }, deadline, 20*time.Millisecond)
	return t.unreaped()
}

func handleKill(c *conn, h header) error {
	grace := time.Duration(num(h, "grace") * float64(time.Second))
	if grace < 0 || grace > 60*time.Second {
		grace = time.Second
	}
	if left := killTree(int(num(h, "pid")), str(h, "marker"), grace); len(left) > 0 {
		return c.fail("kill_incomplete", strconv.Itoa(len(left))+" processes of the command "+
			"outlived its kill by "+reapBound.String()+" (pids "+fmt.Sprint(left)+
			"); they still hold their share of the sandbox")
	}
	return c.send(header{"t": "ok"}, nil)
}
