package main

// Watching a directory with inotify, for the host's Sandbox.watch: the same
// events, by the same rules, as the host's own inotify watch
// (providers/watching.py's InotifyEvents): created, written, removed,
// renamed (a rename's halves paired by their cookie; out of the tree a
// removal, into it a creation), and under a recursive watch every new
// directory watched, what was already made in it told as created (and a
// file already holding bytes as written).
//
// The host asks {"op": "watch", "path", "recursive"} on a connection of its
// own; the agent answers ok once the watch is set (or an error), then sends
// {"t": "ev", "events": [{"k", "p", "n"?}, ...]} as changes come, "hb" every
// second while there are none, and "end" once the watched directory itself
// is gone. Any frame from the host, or its close, ends the watch.

import (
	"errors"
	"os"
	"strings"
	"syscall"
	"time"
	"unsafe"
)

const watchMask = syscall.IN_CREATE | syscall.IN_MODIFY | syscall.IN_DELETE |
	syscall.IN_MOVED_FROM | syscall.IN_MOVED_TO | syscall.IN_DELETE_SELF |
	syscall.IN_MOVE_SELF | syscall.IN_ONLYDIR | syscall.IN_EXCL_UNLINK

// writeTempPrefix names the temporary files handleWrite renames into place.
const writeTempPrefix = ".hutch-write-"

// renameHalfWait: how long a batch holding a rename's first half waits for
// its second (see translate). The kernel queues both in one rename, so they
// are apart only while the renaming thread is off its CPU; past it, the
// first half was a move out of the tree. The host's is RENAME_HALF_WAIT
// (providers/watching.py).
const renameHalfWait = 50 * time.Millisecond

type treeWatch struct {
	fd        int
	root      string
	recursive bool
	dirs      map[int32]string
	ended     bool
	// held: a batch held for a rename's second half; movedFrom: by cookie,
	// the renames in it whose IN_MOVED_TO has not been read yet.
	held      []header
	movedFrom map[uint32]movedFrom
}

func joinPath(dir, name string) string {
	return strings.TrimRight(dir, "/") + "/" + name
}

// watchTree watches path and, recursive, every directory below it; with
// told, what is already there is told as created (made before its watch).
func (w *treeWatch) watchTree(path string, told *[]header) error {
	pending := []string{path}
	for len(pending) > 0 {
		dir := pending[len(pending)-1]
		pending = pending[:len(pending)-1]
		wd, err := syscall.InotifyAddWatch(w.fd, dir, watchMask)
		if err != nil {
			if dir == path && told == nil {
				return err
			}
			continue // gone again already
		}
		w.dirs[int32(wd)] = dir
		if !w.recursive && told == nil {
			continue
		}
		entries, err := os.ReadDir(dir)
		if err != nil {
			continue
		}
		for _, e := range entries {
			child := joinPath(dir, e.Name())
			if strings.HasPrefix(e.Name(), writeTempPrefix) && !e.IsDir() {
				// A write of the agent's under way in a directory it made: its
				// file is told when it is put in place, never its temporary one.
				continue
			}
			if told != nil {
				*told = append(*told, header{"k": "created", "p": child})
				// Bytes in it were written before the watch could see them.
				if e.Type().IsRegular() {
					if info, err := e.Info(); err == nil && info.Size() > 0 {
						*told = append(*told, header{"k": "written", "p": child})
					}
				}
			}
			if e.IsDir() && w.recursive {
				pending = append(pending, child)
			}
		}
	}
	return nil
}

func (w *treeWatch) forgetBelow(path string) {
	prefix := strings.TrimRight(path, "/") + "/"
	for wd, dir := range w.dirs {
		if dir == path || strings.HasPrefix(dir, prefix) {
			delete(w.dirs, wd)
			_, _ = syscall.InotifyRmWatch(w.fd, uint32(wd))
		}
	}
}

func (w *treeWatch) movedBelow(old, now string) {
	prefix := strings.TrimRight(old, "/") + "/"
	for wd, dir := range w.dirs {
		if dir == old {
			w.dirs[wd] = now
		} else if strings.HasPrefix(dir, prefix) {
			w.dirs[wd] = strings.TrimRight(now, "/") + "/" + dir[len(prefix):]
		}
	}
}

type movedFrom struct {
	path  string
	isDir bool
	at    int // its placeholder "removed" in the batch
}

// translate turns one read's events into hutch's: what is told now;
// overflow is an error. The kernel queues a rename's two halves one after
// the other, and a read can come between them: a batch with an
// IN_MOVED_FROM whose IN_MOVED_TO has not come is held (nil is returned),
// and the next read's events join it, until its other half pairs it or
// flush tells it moved out.
func (w *treeWatch) translate(buf []byte) ([]header, error) {
	out := w.held
	if w.movedFrom == nil {
		w.movedFrom = map[uint32]movedFrom{}
	}
	pending := w.movedFrom
	for off := 0; off+syscall.SizeofInotifyEvent <= len(buf); {
		ev := (*syscall.InotifyEvent)(unsafe.Pointer(&buf[off]))
		nameBytes := buf[off+syscall.SizeofInotifyEvent : off+syscall.SizeofInotifyEvent+int(ev.Len)]
		off += syscall.SizeofInotifyEvent + int(ev.Len)
		name := strings.TrimRight(string(nameBytes), "\x00")
		mask := ev.Mask
		if mask&syscall.IN_Q_OVERFLOW != 0 {
			return nil, errors.New("overflow")
		}
		dir, known := w.dirs[ev.Wd]
		if !known {
			continue
		}
		if mask&syscall.IN_IGNORED != 0 {
			delete(w.dirs, ev.Wd)
			if dir == w.root {
				w.ended = true
			}
			continue
		}
		if mask&(syscall.IN_DELETE_SELF|syscall.IN_MOVE_SELF) != 0 {
			if dir == w.root {
				w.ended = true
			}
			continue
		}
		path := joinPath(dir, name)
		isDir := mask&syscall.IN_ISDIR != 0
		// The agent's own writes go through a temporary file renamed into
		// place: told as what they are to the caller, the file written.
		if strings.HasPrefix(name, writeTempPrefix) && !isDir {
			if mask&syscall.IN_MOVED_FROM != 0 {
				pending[ev.Cookie] = movedFrom{path, false, -1}
			}
			continue
		}
		switch {
		case mask&syscall.IN_CREATE != 0:
			out = append(out, header{"k": "created", "p": path})
			if isDir && w.recursive {
				_ = w.watchTree(path, &out)
			}
		case mask&syscall.IN_MODIFY != 0:
			if n := len(out); n == 0 || out[n-1]["k"] != "written" || out[n-1]["p"] != path {
				out = append(out, header{"k": "written", "p": path})
			}
		case mask&syscall.IN_DELETE != 0:
			out = append(out, header{"k": "removed", "p": path})
		case mask&syscall.IN_MOVED_FROM != 0:
			pending[ev.Cookie] = movedFrom{path, isDir, len(out)}
			out = append(out, header{"k": "removed", "p": path}) // until its other half comes
		case mask&syscall.IN_MOVED_TO != 0:
			from, paired := pending[ev.Cookie]
			if !paired {
				out = append(out, header{"k": "created", "p": path})
				if isDir && w.recursive {
					_ = w.watchTree(path, &out)
				}
				continue
			}
			delete(pending, ev.Cookie)
			if from.at < 0 { // a write of the agent's, put in place
				out = append(out, header{"k": "created", "p": path}, header{"k": "written", "p": path})
				continue
			}
			out[from.at] = header{"k": "renamed", "p": from.path, "n": path}
			if from.isDir && w.recursive {
				w.movedBelow(from.path, path)
			}
		}
	}
	if len(pending) > 0 {
		w.held = out
		return nil, nil
	}
	w.held = nil
	return out, nil
}

// awaitingRenameHalf: a batch is held for a rename's second half.
func (w *treeWatch) awaitingRenameHalf() bool {
	return len(w.movedFrom) > 0
}

// flush: the held batch, as it is; a rename half whose other half never came
// was a move out of the tree (told as a removal; an agent's temporary file,
// not at all).
func (w *treeWatch) flush() []header {
	for cookie, from := range w.movedFrom {
		if from.isDir {
			w.forgetBelow(from.path) // moved out of the tree
		}
		delete(w.movedFrom, cookie)
	}
	out := w.held
	w.held = nil
	return out
}

func handleWatch(c *conn, h header) error {
	root := strings.TrimRight(str(h, "path"), "/")
	if root == "" {
		root = "/"
	}
	st, err := os.Stat(root)
	if err != nil {
		return failPath(c, err, root)
	}
	if !st.IsDir() {
		_ = c.fail("not_a_directory", root+" is not a directory to watch")
		return errors.New("refused")
	}
	fd, err := syscall.InotifyInit1(syscall.IN_NONBLOCK | syscall.IN_CLOEXEC)
	if err != nil {
		return failWatchLimit(c, err)
	}
	// Nonblocking, so the runtime's poller serves it: a read with a
	// deadline (for the heartbeat), and a close that ends a read under way.
	events := os.NewFile(uintptr(fd), "inotify")
	defer events.Close()
	w := &treeWatch{fd: fd, root: root, recursive: boolean(h, "recursive"), dirs: map[int32]string{}}
	if err := w.watchTree(root, nil); err != nil {
		if errors.Is(err, syscall.ENOSPC) || errors.Is(err, syscall.ENOMEM) {
			return failWatchLimit(c, err)
		}
		return failPath(c, err, root)
	}
	if err := c.send(header{"t": "ok"}, nil); err != nil {
		return err
	}
	hostDone := make(chan struct{})
	go func() {
		_, _, _ = c.readFrame() // any frame, or the host's close, ends the watch
		close(hostDone)
		events.Close()
	}()
	buf := make([]byte, 256<<10)
	// When a batch held for a rename's second half is told without it
	// (bounded even while other events keep coming).
	var heldUntil time.Time
	for {
		var batch []header
		if w.awaitingRenameHalf() && heldUntil.IsZero() {
			heldUntil = time.Now().Add(renameHalfWait)
		}
		if !heldUntil.IsZero() {
			_ = events.SetReadDeadline(heldUntil)
		} else {
			_ = events.SetReadDeadline(time.Now().Add(time.Second))
		}
		n, err := events.Read(buf)
		if err != nil {
			select {
			case <-hostDone:
				return errors.New("watch ended")
			default:
			}
			if !errors.Is(err, os.ErrDeadlineExceeded) {
				_ = c.fail("provider_error", "reading the watch's events: "+err.Error())
				return err
			}
			if heldUntil.IsZero() {
				if err := c.send(header{"t": "hb"}, nil); err != nil {
					return err
				}
				continue
			}
		} else if batch, err = w.translate(buf[:n]); err != nil {
			_ = c.fail("output_limit_exceeded",
				"the watch fell behind and the kernel dropped events: watch a smaller tree, or read its events sooner")
			return err
		}
		if w.ended || (!heldUntil.IsZero() && !time.Now().Before(heldUntil)) {
			batch = append(batch, w.flush()...)
		}
		if !w.awaitingRenameHalf() {
			heldUntil = time.Time{}
		}
		if err := sendEvents(c, batch); err != nil {
			return err
		}
		if w.ended {
			_ = c.send(header{"t": "end"}, nil)
			return errors.New("watch ended")
		}
	}
}

func sendEvents(c *conn, batch []header) error {
	if len(batch) == 0 {
		return nil
	}
	items := make([]interface{}, len(batch))
	for i, e := range batch {
		items[i] = e
	}
	return c.send(header{"t": "ev", "events": items}, nil)
}

// failWatchLimit: the kernel's inotify limits reached (instances or watches
// per user), or another failure to watch.
func failWatchLimit(c *conn, err error) error {
	if errors.Is(err, syscall.EMFILE) || errors.Is(err, syscall.ENFILE) ||
		errors.Is(err, syscall.ENOSPC) || errors.Is(err, syscall.ENOMEM) {
		_ = c.fail("resource_exhausted", "the sandbox watches all it may ("+err.Error()+
			"): close other watches, or watch a smaller tree")
	} else {
		_ = c.fail("provider_error", "inotify: "+err.Error())
	}
	return err
}
