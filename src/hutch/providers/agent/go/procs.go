package main

import (
	"bufio"
	"bytes"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
	"unsafe"
)

// -- reaping ----------------------------------------------------------------

var (
	reapMu sync.Mutex
	// waiters: each child spawned and not reaped yet (the reaper reaps and
	// drops it under reapMu): its pid, and so its process group's number,
	// is its own while it is listed.
	waiters = map[int]chan syscall.WaitStatus{}
)

// startReaper reaps every child that ends, ours or an orphan's: a status
// someone waits for goes to them, the rest are dropped (as an init does).
func startReaper() {
	sigchld := make(chan os.Signal, 16)
	signal.Notify(sigchld, syscall.SIGCHLD)
	go func() {
		for range sigchld {
			for {
				var status syscall.WaitStatus
				// Reaped and dropped at once: see waiters.
				reapMu.Lock()
				pid, err := syscall.Wait4(-1, &status, syscall.WNOHANG, nil)
				if pid > 0 && err == nil {
					if ch, ok := waiters[pid]; ok {
						ch <- status
						delete(waiters, pid)
					}
				}
				reapMu.Unlock()
				if pid <= 0 || err != nil {
					break
				}
			}
		}
	}()
}

// spawn starts a child and registers it before the reaper can see it end.
func spawn(path string, argv []string, attr *syscall.ProcAttr) (int, chan syscall.WaitStatus, error) {
	reapMu.Lock()
	defer reapMu.Unlock()
	pid, err := forkExec(path, argv, attr)
	if err != nil {
		return 0, nil, err
	}
	ch := make(chan syscall.WaitStatus, 1)
	waiters[pid] = ch
	return pid, ch, nil
}

// unreapedChild: whether pid is a child of ours not reaped yet (alive, or a
// zombie): its pid, and the process group it leads, are still its own.
func unreapedChild(pid int) bool {
	reapMu.Lock()
	defer reapMu.Unlock()
	_, ok := waiters[pid]
	return ok
}

func exitCode(status syscall.WaitStatus) int {
	if status.Signaled() {
		return 128 + int(status.Signal())
	}
	return status.ExitStatus()
}

// -- users --------------------------------------------------------------------

type account struct {
	uid, gid uint32
	groups   []uint32
	home     string
}

func readLines(path string) []string {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil
	}
	return strings.Split(string(data), "\n")
}

// resolveUser reads "name", "uid", "name:group" or "uid:gid" against the
// image's /etc/passwd and /etc/group, as docker exec does (a numeric uid
// needs no entry).
func resolveUser(spec string) (*account, bool) {
	userPart, groupPart, hasGroup := strings.Cut(spec, ":")
	acct := &account{home: "/"}
	found := false
	name := ""
	for _, line := range readLines("/etc/passwd") {
		f := strings.Split(line, ":")
		if len(f) < 7 {
			continue
		}
		if f[0] == userPart || f[2] == userPart {
			uid, err1 := strconv.ParseUint(f[2], 10, 32)
			gid, err2 := strconv.ParseUint(f[3], 10, 32)
			if err1 != nil || err2 != nil {
				continue
			}
			acct.uid, acct.gid, acct.home, name, found = uint32(uid), uint32(gid), f[5], f[0], true
			break
		}
	}
	if !found {
		uid, err := strconv.ParseUint(userPart, 10, 32)
		if err != nil {
			return nil, false
		}
		acct.uid, acct.gid = uint32(uid), uint32(uid)
	}
	groups := readLines("/etc/group")
	if hasGroup {
		gid, err := strconv.ParseUint(groupPart, 10, 32)
		if err != nil {
			ok := false
			for _, line := range groups {
				f := strings.Split(line, ":")
				if len(f) >= 3 && f[0] == groupPart {
					if g, err := strconv.ParseUint(f[2], 10, 32); err == nil {
						gid, ok = g, true
					}
					break
				}
			}
			if !ok {
				return nil, false
			}
		}
		acct.gid = uint32(gid)
	}
	acct.groups = []uint32{acct.gid}
	if name != "" {
		for _, line := range groups {
			f := strings.Split(line, ":")
			if len(f) < 4 {
				continue
			}
			for _, member := range strings.Split(f[3], ",") {
				if member == name {
					if g, err := strconv.ParseUint(f[2], 10, 32); err == nil && uint32(g) != acct.gid {
						acct.groups = append(acct.groups, uint32(g))
					}
				}
			}
		}
	}
	return acct, true
}

// -- exec -----------------------------------------------------------------------

// lookPath finds the executable argv[0] names as execve would from cwd: a
// name with a slash as it is (a relative one from cwd, where the command
// starts, not from the agent's own directory), any other on PATH.
func lookPath(name, cwd string, env []string) (string, string, string) {
	check := func(p string) (string, string) {
		if !filepath.IsAbs(p) {
			p = filepath.Join(cwd, p)
		}
		st, err := os.Stat(p)
		if err != nil {
			return "file_not_found", "command not found: " + name
		}
		if st.IsDir() || st.Mode()&0o111 == 0 {
			return "permission_denied", "cannot execute " + name + ": permission denied"
		}
		return "", ""
	}
	if strings.Contains(name, "/") {
		code, msg := check(name)
		return name, code, msg
	}
	path := "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
	for _, kv := range env {
		if strings.HasPrefix(kv, "PATH=") {
			path = kv[5:]
		}
	}
	firstCode, firstMsg := "file_not_found", "command not found: "+name
	for _, dir := range filepath.SplitList(path) {
		if dir == "" {
			dir = "."
		}
		candidate := filepath.Join(dir, name)
		if !filepath.IsAbs(candidate) {
			candidate = filepath.Join(cwd, candidate)
		}
		code, msg := check(candidate)
		if code == "" {
			return candidate, "", ""
		}
		if code == "permission_denied" && firstCode == "file_not_found" {
			if _, err := os.Stat(candidate); err == nil {
				firstCode, firstMsg = code, msg
			}
		}
	}
	return "", firstCode, firstMsg
}

func childEnv(extra map[string]string, acct *account) []string {
	merged := map[string]string{}
	order := []string{}
	put := func(k, v string) {
		if _, ok := merged[k]; !ok {
			order = append(order, k)
		}
		merged[k] = v
	}
	for _, kv := range os.Environ() {
		k, v, _ := strings.Cut(kv, "=")
		put(k, v)
	}
	if acct != nil {
		put("HOME", acct.home)
	}
	for k, v := range extra {
		put(k, v)
	}
	out := make([]string, 0, len(order))
	for _, k := range order {
		out = append(out, k+"="+merged[k])
	}
	return out
}

// handleExec runs one command on this connection. It answers whether the
// connection may serve another request: one the host asked to keep
// ("reuse", for a command with no stdin and no PTY: the host sends nothing
// while it runs) serves again once the exit is sent; any other is the
// command's to the end.
func handleExec(c *conn, h header) bool {
	argv, ok := strList(h, "argv")
	if !ok || len(argv) == 0 {
		_ = c.fail("invalid_argument", "argv must be a non-empty list of strings")
		return false
	}
	env, ok := strMap(h, "env")
	if !ok {
		_ = c.fail("invalid_argument", "env must map strings to strings")
		return false
	}
	cwd := str(h, "cwd")
	if cwd == "" {
		cwd = "/"
	}
	var acct *account
	if user := str(h, "user"); user != "" {
		if acct, ok = resolveUser(user); !ok {
			_ = c.fail("no_such_user", "no such user '"+user+"'")
			return false
		}
	}
	if st, err := os.Stat(cwd); err != nil || !st.IsDir() {
		_ = c.fail("file_not_found", "working directory "+cwd+" does not exist")
		return false
	}
	envList := childEnv(env, acct)
	path, code, msg := lookPath(argv[0], cwd, envList)
	if code == "file_not_found" && boolean(h, "shell_fallback") {
		// A shell string runs in bash where the image has it, else in sh.
		if shPath, shCode, _ := lookPath("sh", cwd, envList); shCode == "" {
			argv = append([]string{"sh"}, argv[1:]...)
			path, code = shPath, ""
		}
	}
	if code != "" {
		_ = c.fail(code, msg)
		return false
	}

	attr := &syscall.ProcAttr{Dir: cwd, Env: envList, Sys: &syscall.SysProcAttr{Setsid: true}}
	if acct != nil && (acct.uid != 0 || acct.gid != 0) {
		// The kernel would check the working directory against the new
		// user if the switch came first (a fork sets the user, then changes
		// directory): this agent, re-executed, changes directory as root,
		// then becomes the user and executes the command, as runc does.
		groups := make([]string, len(acct.groups))
		for i, g := range acct.groups {
			groups[i] = strconv.FormatUint(uint64(g), 10)
		}
		argv = append([]string{"hutch-agent", "become",
			strconv.FormatUint(uint64(acct.uid), 10), strconv.FormatUint(uint64(acct.gid), 10),
			strings.Join(groups, ","), path}, argv...)
		path = "/proc/self/exe"
	}
	var (
		parentEnds []*os.File // our ends: stdin writer, stdout reader, stderr reader
		childEnds  []*os.File
		stdinW     *os.File
		outputs    []*os.File
		ptyMaster  *os.File
	)
	closeAll := func(files []*os.File) {
		for _, f := range files {
			if f != nil {
				f.Close()
			}
		}
	}
	if pty, ok := h["pty"].(map[string]interface{}); ok {
		master, slave, err := openPty()
		if err != nil {
			_ = c.fail("provider_error", "cannot open a pty: "+err.Error())
			return false
		}
		setWinsize(master, uint16(num(header(pty), "rows")), uint16(num(header(pty), "cols")))
		attr.Files = []uintptr{slave.Fd(), slave.Fd(), slave.Fd()}
		attr.Sys.Setctty = true
		attr.Sys.Ctty = 0
		childEnds = []*os.File{slave}
		parentEnds = []*os.File{master}
		ptyMaster, stdinW, outputs = master, master, []*os.File{master}
	} else {
		var stdinR *os.File
		var err error
		if boolean(h, "stdin") {
			stdinR, stdinW, err = os.Pipe()
		} else {
			stdinR, err = os.Open("/dev/null")
		}
		if err != nil {
			_ = c.fail("provider_error", err.Error())
			return false
		}
		outR, outW, err1 := os.Pipe()
		errR, errW, err2 := os.Pipe()
		if err1 != nil || err2 != nil {
			closeAll([]*os.File{stdinR, stdinW, outR, outW, errR, errW})
			_ = c.fail("provider_error", "cannot make pipes")
			return false
		}
		attr.Files = []uintptr{stdinR.Fd(), outW.Fd(), errW.Fd()}
		childEnds = []*os.File{stdinR, outW, errW}
		parentEnds = []*os.File{stdinW, outR, errR}
		outputs = []*os.File{outR, errR}
	}
	oomBefore := oomKills()
	pid, exited, err := spawn(path, argv, attr)
	closeAll(childEnds)
	if err != nil {
		closeAll(parentEnds)
		code, msg := "provider_error", "cannot execute "+argv[0]+": "+err.Error()
		switch err {
		case syscall.ENOENT, syscall.ENOTDIR:
			code = "file_not_found"
		case syscall.EACCES, syscall.EPERM, syscall.ENOEXEC:
			code = "permission_denied"
		case syscall.EAGAIN:
			// The fork was refused: the workload is at its pids limit. The
			// sandbox is sound, it is full, until something in it ends.
			code = "resource_exhausted"
			msg = "cannot start " + argv[0] + ": the sandbox is at its pids limit (" +
				err.Error() + "); it starts once a process in the sandbox ends"
		}
		_ = c.fail(code, msg)
		return false
	}
	if c.send(header{"t": "started", "pid": pid}, nil) != nil {
		killTree(pid, str(h, "marker"), 0)
		closeAll(parentEnds)
		return false
	}

	// The host's frames: stdin data, its end, and a PTY's window size.
	reuse := boolean(h, "reuse") && stdinW == nil && ptyMaster == nil
	if !reuse {
		go readInput(c, stdinW, ptyMaster)
	}

	var pumps sync.WaitGroup
	for i, f := range outputs {
		pumps.Add(1)
		stream := i + 1
		go func(f *os.File) {
			defer pumps.Done()
			buf := make([]byte, 64<<10)
			for {
				n, err := f.Read(buf)
				if n > 0 {
					if c.send(header{"t": "out", "s": stream}, buf[:n]) != nil {
						// The host is gone (or the agent let go of it): the
						// command's next write fails rather than blocking on
						// a pipe no one reads.
						f.Close()
						return
					}
				}
				if err != nil {
					return
				}
			}
		}(f)
	}
	stopBeating := beatWhile(c, 2*heartbeatEvery) // a quiet command is not a wedged agent
	status := <-exited
	if ptyMaster != nil {
		// A PTY's master reads EIO once no process holds the slave; a
		// background job holding it would keep a shell session open forever.
		done := make(chan struct{})
		go func() { pumps.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(200 * time.Millisecond):
			ptyMaster.Close()
			pumps.Wait()
		}
	} else {
		pumps.Wait()
	}
	stopBeating() // no heartbeat after the exit: the connection may serve again
	// 137 (a SIGKILL, its own or a pipeline's last command's) with the
	// sandbox's cgroup counting more OOM kills than at the start: the
	// kernel's OOM killer ended it (or what it ran).
	oom := exitCode(status) == 128+int(syscall.SIGKILL) && oomBefore >= 0 &&
		oomCountedSince(oomBefore)
	if c.send(header{"t": "exit", "code": exitCode(status), "oom": oom}, nil) != nil {
		closeAll(parentEnds)
		return false
	}
	closeAll(parentEnds)
	return reuse
}

// readInput: the host's frames while a command runs: stdin data, its end,
// and a PTY's window size; the command's stdin is closed when they end.
func readInput(c *conn, stdinW, ptyMaster *os.File) {
	for {
		fh, payload, err := c.readFrame()
		if err != nil {
			break
		}
		switch str(fh, "t") {
		case "in":
			if stdinW != nil {
				_, _ = stdinW.Write(payload)
			}
		case "eof":
			if stdinW != nil && ptyMaster == nil {
				stdinW.Close()
				stdinW = nil
			}
		case "resize":
			if ptyMaster != nil {
				setWinsize(ptyMaster, uint16(num(fh, "rows")), uint16(num(fh, "cols")))
			}
		}
	}
	if stdinW != nil && ptyMaster == nil {
		stdinW.Close()
	}
}

// -- the busy count -------------------------------------------------------------------

// countBusy: live processes in the sandbox other than its keepers (this agent
// and the inits above it) and hutch's own relays to it (this executable, run
// through the pod's exec: the kept connection is no work of the sandbox's);
// zombies are not alive. With running, only those on a CPU or in
// uninterruptible I/O (R, D) count.
func countBusy(running bool) int {
	keepers := map[int]bool{}
	for pid := os.Getpid(); pid > 0 && !keepers[pid]; {
		keepers[pid] = true
		pid = parentOf(pid)
	}
	self, selfName := thisExecutable()
	entries, _ := os.ReadDir("/proc")
	n := 0
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || keepers[pid] {
			continue
		}
		data, err := os.ReadFile("/proc/" + e.Name() + "/stat")
		if err != nil {
			continue
		}
		end := bytes.LastIndexByte(data, ')')
		if end < 0 || end+2 >= len(data) || data[end+2] == 'Z' || data[end+2] == 'X' {
			continue
		}
		if running && data[end+2] != 'R' && data[end+2] != 'D' {
			continue
		}
		if runsThisExecutable(e.Name(), data, self, selfName) {
			continue
		}
		n++
	}
	return n
}

var (
	thisExecutableOnce sync.Once
	thisExe            os.FileInfo
	thisName           []byte
)

// thisExecutable: the agent's own executable and its name (nil where they
// cannot be read), looked up once: neither changes while it runs, and the
// busy count, asked every few seconds, need not read them each time.
func thisExecutable() (os.FileInfo, []byte) {
	thisExecutableOnce.Do(func() {
		thisExe, _ = os.Stat("/proc/self/exe")
		stat, _ := os.ReadFile("/proc/self/stat")
		thisName = commOf(stat)
	})
	return thisExe, thisName
}

// runsThisExecutable: whether process pid (stat: its /proc/N/stat line) runs
// self, this executable (selfName: its name). A relay bears this name, so
// only a process so named is worth the look at its executable (a stat).
func runsThisExecutable(pid string, stat []byte, self os.FileInfo, selfName []byte) bool {
	if self == nil || selfName == nil || !bytes.Equal(commOf(stat), selfName) {
		return false
	}
	exe, err := os.Stat("/proc/" + pid + "/exe")
	return err == nil && os.SameFile(self, exe)
}

// commOf: the name in a /proc/N/stat line (between its first '(' and last
// ')'); nil when it has none.
func commOf(stat []byte) []byte {
	start, end := bytes.IndexByte(stat, '('), bytes.LastIndexByte(stat, ')')
	if start < 0 || end <= start {
		return nil
	}
	return stat[start+1 : end]
}

func parentOf(pid int) int {
	f, err := os.Open("/proc/" + strconv.Itoa(pid) + "/status")
	if err != nil {
		return 0
	}
	defer f.Close()
	scanner := bufio.NewScanner(f)
	for scanner.Scan() {
		if line := scanner.Text(); strings.HasPrefix(line, "PPid:") {
			ppid, _ := strconv.Atoi(strings.TrimSpace(line[5:]))
			return ppid
		}
	}
	return 0
}

// -- PTY ----------------------------------------------------------------------------------

func openPty() (*os.File, *os.File, error) {
	master, err := os.OpenFile("/dev/ptmx", os.O_RDWR|syscall.O_NOCTTY, 0)
	if err != nil {
		return nil, nil, err
	}
	var unlock int32
	var n uint32
	if e := ioctl(master, syscall.TIOCSPTLCK, unsafe.Pointer(&unlock)); e != nil {
		master.Close()
		return nil, nil, e
	}
	if e := ioctl(master, syscall.TIOCGPTN, unsafe.Pointer(&n)); e != nil {
		master.Close()
		return nil, nil, e
	}
	slave, err := os.OpenFile("/dev/pts/"+strconv.Itoa(int(n)), os.O_RDWR|syscall.O_NOCTTY, 0)
	if err != nil {
		master.Close()
		return nil, nil, err
	}
	return master, slave, nil
}

func setWinsize(f *os.File, rows, cols uint16) {
	if rows == 0 || cols == 0 {
		rows, cols = 24, 80
	}
	ws := [4]uint16{rows, cols, 0, 0}
	_ = ioctl(f, syscall.TIOCSWINSZ, unsafe.Pointer(&ws))
}

// ioctl through the file's raw descriptor, leaving it non-blocking (File.Fd
// would not), so that closing the master ends a read blocked on it.
func ioctl(f *os.File, request uintptr, arg unsafe.Pointer) error {
	raw, err := f.SyscallConn()
	if err != nil {
		return err
	}
	var errno syscall.Errno
	if err := raw.Control(func(fd uintptr) {
		_, _, errno = syscall.Syscall(syscall.SYS_IOCTL, fd, request, uintptr(arg))
	}); err != nil {
		return err
	}
	if errno != 0 {
		return errno
	}
	return nil
}

// become: the far side of a user switch (see handleExec): already in the
// working directory, drop to the user and execute the command in place.
func become(args []string) {
	if len(args) < 5 {
		os.Exit(127)
	}
	uid, _ := strconv.Atoi(args[0])
	gid, _ := strconv.Atoi(args[1])
	var groups []int
	for _, g := range strings.Split(args[2], ",") {
		if n, err := strconv.Atoi(g); err == nil {
			groups = append(groups, n)
		}
	}
	path, argv := args[3], args[4:]
	if err := syscall.Setgroups(groups); err != nil {
		fail("setgroups", err)
	}
	if err := syscall.Setgid(gid); err != nil {
		fail("setgid", err)
	}
	if err := syscall.Setuid(uid); err != nil {
		fail("setuid", err)
	}
	err := syscall.Exec(path, argv, os.Environ())
	fail(path, err)
}

func fail(what string, err error) {
	os.Stderr.WriteString("hutch-agent: " + what + ": " + err.Error() + "\n")
	if err == syscall.ENOENT {
		os.Exit(127)
	}
	os.Exit(126)
}

// oomCountedSince: whether the OOM kill count has passed before, given a
// moment to: the kernel counts a kill (memory.events, memory.oom_control)
// after it sends the SIGKILL, so a victim reaped at once can be seen dead
// before its kill is counted. Only a SIGKILLed command pays the wait.
func oomCountedSince(before int) bool {
	for i := 0; ; i++ {
		if oomKills() > before {
			return true
		}
		if i == 20 {
			return false
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// oomKills: the OOM kills the memory cgroup of what the agent runs has
// counted (the workload's, or the sandbox's own seen through the cgroup
// namespace), or -1 where it cannot tell.
func oomKills() int {
	reapMu.Lock()
	paths := []string{"/sys/fs/cgroup/memory.events", "/sys/fs/cgroup/memory/memory.oom_control"}
	if workloadOOM != "" {
		// The workload's own cgroup: cgroup v1 counts a kill where it happened only.
		paths = []string{workloadOOM}
	}
	reapMu.Unlock()
	for _, path := range paths {
		data, err := os.ReadFile(path)
		if err != nil {
			continue
		}
		for _, line := range strings.Split(string(data), "\n") {
			if strings.HasPrefix(line, "oom_kill ") {
				n, err := strconv.Atoi(strings.TrimSpace(line[len("oom_kill "):]))
				if err == nil {
					return n
				}
			}
		}
	}
	return -1
}
