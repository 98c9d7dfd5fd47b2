package main

import (
	"os"
	"os/exec"
	"strconv"
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
