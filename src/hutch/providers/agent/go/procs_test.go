package main

import (
	"os"
	"os/exec"
	"strconv"
	"syscall"
	"testing"
	"time"
)

// TestMain: a child started with HUTCH_AGENT_TEST_SLEEP runs this test
// binary as a stand-in for a relay (the same executable), and only sleeps.
func TestMain(m *testing.M) {
	if os.Getenv("HUTCH_AGENT_TEST_SLEEP") != "" {
		time.Sleep(30 * time.Second)
		os.Exit(0)
	}
	if os.Getenv("HUTCH_AGENT_TEST_SPAWNER") != "" {
		placeSpawnerAndSayWhere() // on the main goroutine, as main() does
	}
	os.Exit(m.Run())
}

func started(t *testing.T, cmd *exec.Cmd) string {
	t.Helper()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	return strconv.Itoa(cmd.Process.Pid)
}

// The busy count leaves out processes of this executable (the relays) and
// only those: a process with another executable counts, also one that bears
// the same name.
func TestOnlyThisExecutablesProcessesAreRelays(t *testing.T) {
	self, err := os.Stat("/proc/self/exe")
	if err != nil {
		t.Fatal(err)
	}
	selfStat, _ := os.ReadFile("/proc/self/stat")
	selfName := commOf(selfStat)
	me, _ := os.Executable()
	relay := exec.Command(me)
	relay.Env = append(os.Environ(), "HUTCH_AGENT_TEST_SLEEP=1")
	other := exec.Command("sleep", "30")
	// Another executable under this one's name: exec -a sets argv[0], and
	// the kernel names a process by its executable's file, so copy sleep there.
	dir := t.TempDir()
	namesake := dir + "/" + string(selfName)
	sleep, err := exec.LookPath("sleep")
	if err != nil {
		t.Fatal(err)
	}
	data, err := os.ReadFile(sleep)
	if err != nil || os.WriteFile(namesake, data, 0o755) != nil {
		t.Fatal("copying sleep", err)
	}
	cases := map[string]bool{started(t, relay): true, started(t, other): false,
		started(t, exec.Command(namesake, "30")): false}
	time.Sleep(100 * time.Millisecond) // each has exec'd its program
	for pid, want := range cases {
		stat, err := os.ReadFile("/proc/" + pid + "/stat")
		if err != nil {
			t.Fatal(err)
		}
		if got := runsThisExecutable(pid, stat, self, selfName); got != want {
			t.Errorf("pid %s (%s): runs this executable: %v, want %v", pid, commOf(stat), got, want)
		}
	}
}

// aliveNow: whether pid is a process that has not ended (a zombie has).
func aliveNow(pid int) bool {
	st, ok := readStat(pid)
	return ok && st.state != 'Z' && st.state != 'X'
}

// reaped: cmd's process waited for in the background, as the agent's
// reaper would, so that a kill's wait for zombies ends.
func reaped(t *testing.T, cmd *exec.Cmd) int {
	t.Helper()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { _ = cmd.Wait() }()
	t.Cleanup(func() { _ = cmd.Process.Kill() })
	return cmd.Process.Pid
}

// A kill whose command's group is gone, its number taken since by another
// command's group (the same number here, as after the pid space went
// round), spares that group: no process of it is the command's.
func TestAKillSparesALaterGroupUnderTheSameNumber(t *testing.T) {
	later := exec.Command("sleep", "30")
	later.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	pid := reaped(t, later)
	time.Sleep(50 * time.Millisecond)
	if left := killTree(pid, "HUTCH_EXEC_ID=gone-command", 0); len(left) != 0 {
		t.Errorf("the kill says %v are left", left)
	}
	if !aliveNow(pid) {
		t.Fatal("a later command's group was killed by an old command's kill")
	}
}

// The command's group is its own while its leader (a child not reaped) or
// a marked member holds it: a member that cleared its environment is
// killed with it, and so is a leader that cleared its own.
func TestAKillEndsTheGroupWhileTheCommandHoldsIt(t *testing.T) {
	marker := "HUTCH_EXEC_ID=held-" + strconv.Itoa(os.Getpid())
	marked := exec.Command("sh", "-c", "env -i sleep 31 & wait")
	marked.Env = append(os.Environ(), marker)
	marked.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	markedPid := reaped(t, marked)

	unmarked := exec.Command("env", "-i", "sleep", "32")
	unmarked.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	leader := reaped(t, unmarked)
	time.Sleep(100 * time.Millisecond) // each has exec'd its program
	reapMu.Lock()
	waiters[leader] = make(chan syscall.WaitStatus, 1) // as spawn lists it
	reapMu.Unlock()
	defer func() { reapMu.Lock(); delete(waiters, leader); reapMu.Unlock() }()

	members := func(group int) []int {
		var found []int
		entries, _ := os.ReadDir("/proc")
		for _, e := range entries {
			if p, err := strconv.Atoi(e.Name()); err == nil {
				if s, ok := readStat(p); ok && s.group == group && aliveNow(p) {
					found = append(found, p)
				}
			}
		}
		return found
	}
	if n := len(members(markedPid)); n != 2 {
		t.Fatalf("the marked command's group has %d processes, want 2", n)
	}
	killTree(markedPid, marker, 0)
	if left := members(markedPid); len(left) != 0 {
		t.Errorf("left of the marked command's group: %v", left)
	}
	killTree(leader, "HUTCH_EXEC_ID=unmarked", 0)
	if aliveNow(leader) {
		t.Error("a leader that cleared its environment outlived its kill")
	}
}
