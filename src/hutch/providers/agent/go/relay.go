package main

// `hutch-agent relay SOCKET`: many connections to the agent's socket over one
// byte stream, this process's stdin and stdout. It is how hutch reaches an
// agent it cannot reach by a socket of its own: in a Kubernetes pod, through
// one kept `pods/exec` whose stdin and stdout are the stream.
//
// A frame, both ways: the stream's number (4 bytes, big-endian), a kind (1
// byte), the payload's length (4 bytes) and the payload. Kinds:
//
//	open   (host): connect stream N to SOCKET
//	data   (both): bytes of stream N
//	close  (both): stream N is done (the sender closed or lost its end);
//	               its payload may say why
//	credit (both): the receiver passed on this many more bytes of stream N
//	               (4 bytes): each side sends a stream at most `window`
//	               bytes ahead of the credit it got, so a stream whose reader
//	               is slow holds back only itself, never the others
//
// The relay ends when its stdin ends (the host went away): every connection
// it made closes with it, as a dropped socket connection would.

import (
	"bufio"
	"encoding/binary"
	"io"
	"net"
	"os"
	"sync"
)

const (
	relayOpen   = 1
	relayData   = 2
	relayClose  = 3
	relayCredit = 4
	// How far ahead of its credit a side may send one stream.
	relayWindow = 1 << 20
	// The largest payload of a frame either side sends or takes.
	relayMaxFrame = 1 << 16
	// Credit is given back in pieces of at least this much (a frame each
	// way per request would double the messages on the connection).
	relayCreditStep = relayWindow / 4
)

type relayStream struct {
	id   uint32
	conn net.Conn
	mu   sync.Mutex
	cond *sync.Cond
	// Bytes from the host not yet written to conn, and whether the host closed.
	pending [][]byte
	closed  bool
	// How many more bytes this side may send the host.
	window int
	done   bool // conn's reading side ended: the host has been told
	// Bytes written to conn and not yet credited to the host.
	uncredited int
}

type relay struct {
	out     *bufio.Writer
	outMu   sync.Mutex
	socket  string
	mu      sync.Mutex
	streams map[uint32]*relayStream
}

func runRelay(socketPath string) {
	r := &relay{out: bufio.NewWriterSize(os.Stdout, 1<<17), socket: socketPath,
		streams: map[uint32]*relayStream{}}
	in := bufio.NewReaderSize(os.Stdin, 1<<17)
	var head [9]byte
	for {
		if _, err := io.ReadFull(in, head[:]); err != nil {
			break
		}
		id := binary.BigEndian.Uint32(head[:4])
		kind := head[4]
		size := binary.BigEndian.Uint32(head[5:])
		if size > relayMaxFrame {
			break // out of step with the host: nothing after this can be trusted
		}
		payload := make([]byte, size)
		if _, err := io.ReadFull(in, payload); err != nil {
			break
		}
		r.take(id, kind, payload)
	}
	r.mu.Lock()
	for _, s := range r.streams {
		s.conn.Close()
	}
	r.mu.Unlock()
}

func (r *relay) send(id uint32, kind byte, payload []byte) {
	var head [9]byte
	binary.BigEndian.PutUint32(head[:4], id)
	head[4] = kind
	binary.BigEndian.PutUint32(head[5:], uint32(len(payload)))
	r.outMu.Lock()
	defer r.outMu.Unlock()
	_, _ = r.out.Write(head[:])
	_, _ = r.out.Write(payload)
	_ = r.out.Flush()
}

func (r *relay) take(id uint32, kind byte, payload []byte) {
	r.mu.Lock()
	s := r.streams[id]
	r.mu.Unlock()
	switch kind {
	case relayOpen:
		if s != nil {
			return
		}
		conn, err := net.Dial("unix", r.socket)
		if err != nil {
			r.send(id, relayClose, []byte(err.Error()))
			return
		}
		s = &relayStream{id: id, conn: conn, window: relayWindow}
		s.cond = sync.NewCond(&s.mu)
		r.mu.Lock()
		r.streams[id] = s
		r.mu.Unlock()
		go r.toAgent(s)
		go r.fromAgent(s)
	case relayData:
		if s == nil {
			return // a stream already closed here: its last bytes go nowhere
		}
		s.mu.Lock()
		s.pending = append(s.pending, payload)
		s.cond.Broadcast()
		s.mu.Unlock()
	case relayClose:
		if s == nil {
			return
		}
		s.mu.Lock()
		s.closed = true
		s.cond.Broadcast()
		s.mu.Unlock()
	case relayCredit:
		if s == nil || len(payload) != 4 {
			return
		}
		s.mu.Lock()
		s.window += int(binary.BigEndian.Uint32(payload))
		s.cond.Broadcast()
		s.mu.Unlock()
	}
}

// toAgent writes what the host sent to the agent, crediting it as it goes;
// once the host closed the stream and everything is written, the connection
// closes.
func (r *relay) toAgent(s *relayStream) {
	for {
		s.mu.Lock()
		for len(s.pending) == 0 && !s.closed {
			s.cond.Wait()
		}
		if len(s.pending) == 0 {
			s.mu.Unlock()
			break
		}
		piece := s.pending[0]
		s.pending = s.pending[1:]
		s.mu.Unlock()
		if _, err := s.conn.Write(piece); err != nil {
			break
		}
		s.uncredited += len(piece)
		if s.uncredited >= relayCreditStep {
			var credit [4]byte
			binary.BigEndian.PutUint32(credit[:], uint32(s.uncredited))
			s.uncredited = 0
			r.send(s.id, relayCredit, credit[:])
		}
	}
	s.conn.Close()
	r.forget(s)
}

// fromAgent sends what the agent says to the host, within the credit given.
func (r *relay) fromAgent(s *relayStream) {
	buf := make([]byte, relayMaxFrame)
	for {
		s.mu.Lock()
		for s.window <= 0 && !s.closed {
			s.cond.Wait()
		}
		room := s.window
		closed := s.closed
		s.mu.Unlock()
		if closed && room <= 0 {
			break
		}
		if room > len(buf) {
			room = len(buf)
		}
		n, err := s.conn.Read(buf[:room])
		if n > 0 {
			s.mu.Lock()
			s.window -= n
			s.mu.Unlock()
			r.send(s.id, relayData, buf[:n])
		}
		if err != nil {
			break
		}
	}
	s.mu.Lock()
	told := s.closed
	s.done = true
	s.closed = true
	s.cond.Broadcast()
	s.mu.Unlock()
	if !told {
		r.send(s.id, relayClose, nil)
	}
}

func (r *relay) forget(s *relayStream) {
	r.mu.Lock()
	if r.streams[s.id] == s {
		delete(r.streams, s.id)
	}
	r.mu.Unlock()
}
