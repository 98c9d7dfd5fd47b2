package main

// Frames on the socket, both ways: a 4-byte big-endian header length, a 4-byte
// big-endian payload length, the header (a JSON object) and the payload
// (raw bytes). Both lengths are bounded, so neither side ever buffers more
// than one frame's worth of the other's say-so.

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"io"
	"net"
	"os"
	"sync"
	"syscall"
	"time"
)

const (
	maxHeader  = 4 << 20 // argv and env travel in the header
	maxPayload = 1 << 20
	chunkSize  = 1 << 20
	maxFds     = 4 // descriptors one frame of the host's may carry
)

var errFrame = errors.New("malformed frame")

type header map[string]interface{}

type conn struct {
	r  io.Reader
	w  io.Writer
	uc *net.UnixConn // the same connection, for passing descriptors
	mu sync.Mutex    // one frame at a time on the writing side
	// Descriptors that came with the frame read last: an op may take them
	// (takeFds); the next read closes what it left.
	fds []int
	oob [64]byte // room for maxFds descriptors' control message
}

// readFull reads len(buf) bytes, keeping the descriptors that come with them.
func (c *conn) readFull(buf []byte) error {
	if c.uc == nil {
		_, err := io.ReadFull(c.r, buf)
		return err
	}
	oob := c.oob[:syscall.CmsgSpace(maxFds*4)]
	for len(buf) > 0 {
		n, oobn, flags, _, err := c.uc.ReadMsgUnix(buf, oob)
		if oobn > 0 {
			if msgs, perr := syscall.ParseSocketControlMessage(oob[:oobn]); perr == nil {
				for _, m := range msgs {
					if fds, ferr := syscall.ParseUnixRights(&m); ferr == nil {
						c.fds = append(c.fds, fds...)
					}
				}
			}
		}
		if flags&syscall.MSG_CTRUNC != 0 || len(c.fds) > maxFds {
			c.closeFds()
			return errFrame
		}
		if err != nil {
			return err
		}
		if n <= 0 {
			return io.ErrUnexpectedEOF
		}
		buf = buf[n:]
	}
	return nil
}

func (c *conn) takeFds() []int {
	fds := c.fds
	c.fds = nil
	return fds
}

func (c *conn) closeFds() {
	for _, fd := range c.fds {
		syscall.Close(fd)
	}
	c.fds = nil
}

func (c *conn) readFrame() (header, []byte, error) {
	c.closeFds()
	var lens [8]byte
	if err := c.readFull(lens[:]); err != nil {
		return nil, nil, err
	}
	hl := binary.BigEndian.Uint32(lens[:4])
	pl := binary.BigEndian.Uint32(lens[4:])
	if hl == 0 || hl > maxHeader || pl > maxPayload {
		return nil, nil, errFrame
	}
	buf := make([]byte, int(hl)+int(pl))
	if err := c.readFull(buf); err != nil {
		return nil, nil, err
	}
	var h header
	if err := json.Unmarshal(buf[:hl], &h); err != nil || h == nil {
		return nil, nil, errFrame
	}
	return h, buf[hl:], nil
}

func (c *conn) send(h header, payload []byte) error {
	raw, err := json.Marshal(h)
	if err != nil {
		return err
	}
	head := make([]byte, 8, 8+len(raw))
	binary.BigEndian.PutUint32(head[:4], uint32(len(raw)))
	binary.BigEndian.PutUint32(head[4:], uint32(len(payload)))
	head = append(head, raw...)
	c.mu.Lock()
	defer c.mu.Unlock()
	if len(payload) < 4096 {
		_, err = c.w.Write(append(head, payload...))
		return err
	}
	// One writev, the payload not copied.
	bufs := net.Buffers{head, payload}
	_, err = bufs.WriteTo(c.w)
	return err
}

// sendFd sends a frame with an open descriptor attached: the host reads or
// writes the file itself, with no copy through the socket.
func (c *conn) sendFd(h header, f *os.File) error {
	raw, err := json.Marshal(h)
	if err != nil {
		return err
	}
	frame := make([]byte, 8, 8+len(raw))
	binary.BigEndian.PutUint32(frame[:4], uint32(len(raw)))
	binary.BigEndian.PutUint32(frame[4:], 0)
	frame = append(frame, raw...)
	raw2, err := f.SyscallConn()
	if err != nil {
		return err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	var sendErr error
	if err := raw2.Control(func(fd uintptr) {
		_, _, sendErr = c.uc.WriteMsgUnix(frame, syscall.UnixRights(int(fd)), nil)
	}); err != nil {
		return err
	}
	return sendErr
}

func (c *conn) fail(code, msg string) error {
	if len(msg) > 2000 {
		msg = msg[:2000]
	}
	return c.send(header{"t": "err", "code": code, "msg": msg}, nil)
}

func str(h header, key string) string {
	v, _ := h[key].(string)
	return v
}

func num(h header, key string) float64 {
	v, _ := h[key].(float64)
	return v
}

func boolean(h header, key string) bool {
	v, _ := h[key].(bool)
	return v
}

func strList(h header, key string) ([]string, bool) {
	raw, ok := h[key].([]interface{})
	if !ok {
		return nil, false
	}
	out := make([]string, 0, len(raw))
	for _, item := range raw {
		s, ok := item.(string)
		if !ok {
			return nil, false
		}
		out = append(out, s)
	}
	return out, true
}

func strMap(h header, key string) (map[string]string, bool) {
	raw, ok := h[key].(map[string]interface{})
	if !ok {
		return map[string]string{}, h[key] == nil
	}
	out := make(map[string]string, len(raw))
	for k, item := range raw {
		s, ok := item.(string)
		if !ok {
			return nil, false
		}
		out[k] = s
	}
	return out, true
}

// heartbeatEvery: how often a long grep or walk says the agent is alive
// (the host gives up on one silent for 3 s); an exec, whose host waits
// 6 s, beats every two.
var heartbeatEvery = time.Second

// beatWhile sends a heartbeat on c every interval, by the clock, whatever
// the operation is doing (finding nothing for long, waiting on a slow read,
// running a quiet command): the host tells a slow operation from a wedged
// agent. The stop it returns comes back once no heartbeat can follow, so
// that the operation's last frame is the last on the connection.
func beatWhile(c *conn, interval time.Duration) (stop func()) {
	quit := make(chan struct{})
	beating := make(chan struct{})
	go func() {
		defer close(beating)
		ticker := time.NewTicker(interval)
		defer ticker.Stop()
		for {
			select {
			case <-quit:
				return
			case <-ticker.C:
				if c.send(header{"t": "hb"}, nil) != nil {
					return
				}
			}
		}
	}()
	return func() {
		close(quit)
		<-beating
	}
}
