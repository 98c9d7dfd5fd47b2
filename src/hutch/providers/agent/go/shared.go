package main

// serve-shared under gVisor: the agent is the sandbox's pid 1 and its socket
// is a host socket made through gVisor's gofer, which `runsc checkpoint`
// refuses to save. So the host asks the agent to let go of its sockets before
// a checkpoint (the "release" request, or SIGUSR1: the listener and every
// connection closed, the pid file removed last, which the host waits for)
// and to listen again after a restore (a wake file appearing, or SIGUSR2).
// What the agent started lives on meanwhile, and pid 1 stays pid 1: a
// restored sandbox (or each branch of a fork) continues the same process
// tree.

import (
	"errors"
	"fmt"
	"net"
	"os"
	"os/signal"
	"sync"
	"syscall"
	"time"
)

type sockets struct {
	mu       sync.Mutex
	path     string
	listener *net.UnixListener
	conns    map[*net.UnixConn]struct{}
	// shared: serve-shared, whose host may ask it to let go.
	shared bool
}

var served = &sockets{conns: map[*net.UnixConn]struct{}{}}

// track: a new connection is counted, unless the agent has let go meanwhile.
func (s *sockets) track(c *net.UnixConn, from *net.UnixListener) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.listener != from {
		return false
	}
	s.conns[c] = struct{}{}
	return true
}

func (s *sockets) untrack(c *net.UnixConn) {
	s.mu.Lock()
	delete(s.conns, c)
	s.mu.Unlock()
}

// release: nothing of the host's held any more.
func (s *sockets) release() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.listener == nil {
		return
	}
	s.listener.Close()
	s.listener = nil
	for c := range s.conns {
		c.Close()
	}
	s.conns = map[*net.UnixConn]struct{}{}
	// The socket's file may outlive this (a host socket made through the
	// gofer is not always removable from inside; the host removes it):
	// the pid file, removed last, tells the host the agent has let go.
	_ = os.Remove(s.path)
	_ = os.Remove(s.path + ".pid")
	go s.awaitWake(s.path + ".wake")
}

// awaitWake: listening again once the host has made the wake file (before
// it restores the sandbox: the first look after the restore finds it, and
// no runsc kill is needed). The host removes any before it asks for a
// release; SIGUSR2 wakes the agent as well.
func (s *sockets) awaitWake(wake string) {
	for {
		s.mu.Lock()
		listening := s.listener != nil
		s.mu.Unlock()
		if listening {
			return
		}
		if _, err := os.Stat(wake); err == nil {
			_ = os.Remove(wake)
			if err := s.listen(true); err != nil {
				fmt.Fprintln(os.Stderr, "hutch-agent: listening again:", err)
			}
			return
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// listen: a socket at path again (after a release, or the first time).
func (s *sockets) listen(shared bool) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.listener != nil {
		return nil
	}
	l, err := listenAt(s.path)
	if err != nil {
		return err
	}
	s.listener = l
	go s.accept(l, shared)
	return nil
}

func (s *sockets) accept(l *net.UnixListener, shared bool) {
	for {
		c, err := l.AcceptUnix()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			continue
		}
		// serve-shared: under a user-space kernel (gVisor) the host's
		// connections carry that kernel's credentials, not pid 0, so the
		// check cannot tell them apart; the socket's directory (root's,
		// mode 0700) keeps other users inside out instead.
		if !shared && !fromOutside(c) {
			c.Close()
			continue
		}
		if !s.track(c, l) {
			c.Close()
			continue
		}
		go func() {
			defer s.untrack(c)
			serve(c)
		}()
	}
}

// handOverOnSignals: SIGUSR1 lets go, SIGUSR2 listens again.
func (s *sockets) handOverOnSignals() {
	asked := make(chan os.Signal, 4)
	signal.Notify(asked, syscall.SIGUSR1, syscall.SIGUSR2)
	go func() {
		for sig := range asked {
			if sig == syscall.SIGUSR1 {
				s.release()
			} else if err := s.listen(true); err != nil {
				fmt.Fprintln(os.Stderr, "hutch-agent: listening again:", err)
			}
		}
	}()
}
