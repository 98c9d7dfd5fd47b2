// hutch-agent: hutch's runtime inside a sandbox.
//
// It runs as the sandbox's keeper (in place of `sleep infinity`), reaps the
// orphans handed to it as an init does, and serves hutch's host on a unix
// socket in a directory the host bind-mounts in: exec (argv, cwd, env, user,
// stdin, a PTY), killing a command's whole tree, files, walks, grep's
// candidate files and the count of busy processes. Connections from inside
// the sandbox are refused (their peer has a pid in the sandbox's pid
// namespace; the host's has none there), so a process in the sandbox gains
// nothing through the agent that it did not already have.
//
// Standard library only, built with CGO_ENABLED=0: a static executable that
// needs no libc, shell or Python in the image.
package main

import (
	"fmt"
	"net"
	"os"
	"os/signal"
	"runtime"
	"strconv"
	"syscall"
)

const version = "2"

// init holds the main thread for the main goroutine (Go then runs main() on
// it and nothing else): the spawner (workload.go) must be another thread.
// cgroup v1 charges a process's memory to its main thread's memory cgroup,
// and /proc/PID/cgroup shows that thread's cgroups; the spawner moves itself
// into the workload's, where it would take the whole agent. Any goroutine
// may otherwise run on the main thread while the main goroutine waits.
func init() {
	runtime.LockOSThread()
}

func main() {
	if len(os.Args) >= 2 && (os.Args[1] == "become" || os.Args[1] == "relay") {
		runtime.UnlockOSThread() // no spawner here: any thread will do
	}
	if len(os.Args) >= 2 && os.Args[1] == "become" {
		become(os.Args[2:])
		return
	}
	if len(os.Args) == 3 && os.Args[1] == "relay" {
		runRelay(os.Args[2]) // see relay.go: connections to the agent over stdin and stdout
		return
	}
	if len(os.Args) >= 2 && os.Args[1] == "version" {
		fmt.Println(version)
		return
	}
	if len(os.Args) != 3 || (os.Args[1] != "serve" && os.Args[1] != "serve-fd" &&
		os.Args[1] != "serve-shared") {
		fmt.Fprintln(os.Stderr, "usage: hutch-agent serve SOCKET | hutch-agent serve-fd FD | "+
			"hutch-agent serve-shared SOCKET | hutch-agent relay SOCKET | hutch-agent version")
		os.Exit(2)
	}
	if os.Getpid() != 1 {
		// Orphans come to us rather than to an init above us: reaped either way.
		_, _, _ = syscall.RawSyscall(syscall.SYS_PRCTL, 36 /* PR_SET_CHILD_SUBREAPER */, 1, 0)
	}
	startReaper()
	startSpawner()
	signals := make(chan os.Signal, 1)
	signal.Notify(signals, syscall.SIGTERM, syscall.SIGINT, syscall.SIGHUP)
	// A broken pipe is an EPIPE from the write, not the agent's death. Asked
	// for, not ignored: an ignored signal stays ignored in every command the
	// agent starts (`yes | head` would then complain instead of ending),
	// while a caught one is reset to its default by exec.
	signal.Notify(make(chan os.Signal, 1), syscall.SIGPIPE)

	go func() {
		<-signals
		os.Exit(0)
	}()
	if os.Args[1] == "serve-fd" {
		listener, err := inheritedListener(os.Args[2])
		if err != nil {
			fmt.Fprintln(os.Stderr, "hutch-agent:", err)
			os.Exit(1)
		}
		served.listener = listener
		// Accepted on a goroutine of its own: the main goroutine keeps the
		// main thread, and a wakeup there would wait for that very thread.
		go func() {
			served.accept(listener, false)
			os.Exit(0)
		}()
		select {}
	}
	served.path = os.Args[2]
	shared := os.Args[1] == "serve-shared"
	served.shared = shared
	if shared {
		served.handOverOnSignals()
	}
	if err := served.listen(shared); err != nil {
		fmt.Fprintln(os.Stderr, "hutch-agent:", err)
		os.Exit(1)
	}
	select {}
}

// listenAt: a socket of our own at socketPath, owned by the owner of the
// directory it lives in (the host reaches it as that user).
func listenAt(socketPath string) (*net.UnixListener, error) {
	_ = os.Remove(socketPath)
	old := syscall.Umask(0o077)
	listener, err := net.ListenUnix("unix", &net.UnixAddr{Name: socketPath, Net: "unix"})
	syscall.Umask(old)
	if err != nil {
		return nil, err
	}
	listener.SetUnlinkOnClose(false)
	if owner, err := os.Stat(dirOf(socketPath)); err == nil {
		if st, ok := owner.Sys().(*syscall.Stat_t); ok {
			_ = os.Chown(socketPath, int(st.Uid), int(st.Gid))
		}
	}
	_ = os.WriteFile(socketPath+".pid", []byte(strconv.Itoa(os.Getpid())), 0o600)
	return listener, nil
}

// inheritedListener: the listening socket the host made (in a directory of
// its own, which the sandbox cannot reach) and passed down as descriptor fd:
// the host can connect before we run, and waits for our answer rather than
// for a socket file to appear. Ours is a close-on-exec duplicate; the
// inherited descriptor is closed, so no command we start holds it.
func inheritedListener(fd string) (*net.UnixListener, error) {
	n, err := strconv.Atoi(fd)
	if err != nil || n < 3 {
		return nil, fmt.Errorf("serve-fd: %q is not a descriptor to listen on", fd)
	}
	f := os.NewFile(uintptr(n), "listener")
	defer f.Close()
	l, err := net.FileListener(f)
	if err != nil {
		return nil, fmt.Errorf("serve-fd %d: %v", n, err)
	}
	listener, ok := l.(*net.UnixListener)
	if !ok {
		l.Close()
		return nil, fmt.Errorf("serve-fd %d is not a unix socket", n)
	}
	return listener, nil
}

func dirOf(path string) string {
	for i := len(path) - 1; i > 0; i-- {
		if path[i] == '/' {
			return path[:i]
		}
	}
	return "/"
}

// fromOutside: the peer is not a process of this sandbox. SO_PEERCRED gives
// a peer outside our pid namespace the pid 0.
func fromOutside(c *net.UnixConn) bool {
	raw, err := c.SyscallConn()
	if err != nil {
		return false
	}
	ok := false
	_ = raw.Control(func(fd uintptr) {
		cred, err := syscall.GetsockoptUcred(int(fd), syscall.SOL_SOCKET, syscall.SO_PEERCRED)
		ok = err == nil && cred.Pid == 0
	})
	return ok
}

func serve(nc *net.UnixConn) {
	defer nc.Close()
	c := &conn{r: nc, w: nc, uc: nc}
	for {
		h, payload, err := c.readFrame()
		if err != nil {
			if err == errFrame {
				_ = c.fail("invalid_argument", "malformed frame")
			}
			return
		}
		_ = payload
		var opErr error
		switch str(h, "op") {
		case "release":
			// serve-shared: let go of every host socket (see shared.go),
			// this connection's too, once the host has the answer.
			if !served.shared {
				opErr = c.fail("invalid_argument", "release: only when serving shared")
				break
			}
			if c.send(header{"t": "ok"}, nil) == nil {
				served.release()
			}
			return
		case "ping":
			opErr = c.send(header{"t": "ok", "version": version, "pid": os.Getpid()}, nil)
		case "exec":
			if !handleExec(c, h) {
				return // an exec owns its connection to the end, unless the host ended it
			}
		case "kill":
			opErr = handleKill(c, h)
		case "workload":
			opErr = handleWorkload(c, h)
		case "busy":
			opErr = c.send(header{"t": "ok", "count": countBusy(boolean(h, "running"))}, nil)
		case "read":
			opErr = handleRead(c, h)
		case "write":
			opErr = handleWrite(c, h)
		case "stat":
			opErr = handleStat(c, h)
		case "list":
			opErr = handleList(c, h)
		case "remove":
			opErr = handleRemove(c, h)
		case "mkdir":
			opErr = handleMkdir(c, h)
		case "rename":
			opErr = handleRename(c, h)
		case "watch":
			opErr = handleWatch(c, h)
		case "walk":
			opErr = handleWalk(c, h)
		case "grep":
			opErr = handleGrep(c, h)
		default:
			opErr = c.fail("invalid_argument", "unknown operation")
		}
		if opErr != nil {
			return
		}
	}
}
