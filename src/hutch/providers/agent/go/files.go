package main

import (
	"bytes"
	"errors"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"sync"
	"syscall"
)

func errCode(err error) string {
	var errno syscall.Errno
	if !errors.As(err, &errno) {
		return "provider_error"
	}
	switch errno {
	case syscall.ENOENT, syscall.ENOTDIR:
		return "file_not_found"
	case syscall.EISDIR:
		return "is_a_directory"
	case syscall.EACCES, syscall.EPERM, syscall.EROFS:
		return "permission_denied"
	case syscall.ENAMETOOLONG:
		return "invalid_argument"
	}
	return "provider_error"
}

func failPath(c *conn, err error, path string) error {
	switch code := errCode(err); code {
	case "file_not_found":
		return c.fail(code, "no such file or directory: "+path)
	case "is_a_directory":
		return c.fail(code, path+" is a directory")
	case "permission_denied":
		return c.fail(code, "permission denied: "+path)
	case "invalid_argument":
		return c.fail(code, "file name too long: "+path)
	default:
		return c.fail(code, path+": "+err.Error())
	}
}

func fileType(mode fs.FileMode) string {
	switch {
	case mode.IsDir():
		return "directory"
	case mode.IsRegular():
		return "file"
	case mode&fs.ModeSymlink != 0:
		return "symlink"
	}
	return "other"
}

func statHeader(path string, st fs.FileInfo) header {
	mode := uint32(st.Mode().Perm())
	if sys, ok := st.Sys().(*syscall.Stat_t); ok {
		mode = sys.Mode & 0o7777
	}
	return header{
		"path": path, "type": fileType(st.Mode()), "size": st.Size(), "mode": mode,
		"mtime": float64(st.ModTime().UnixNano()) / 1e9,
	}
}

func handleStat(c *conn, h header) error {
	path := str(h, "path")
	st, err := os.Lstat(path)
	if err != nil {
		return failPath(c, err, path)
	}
	reply := statHeader(path, st)
	reply["t"] = "ok"
	return c.send(reply, nil)
}

func handleRead(c *conn, h header) error {
	path := str(h, "path")
	limit := int64(num(h, "limit"))
	// O_NONBLOCK: opening a FIFO must not wait for a writer.
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NONBLOCK, 0)
	if err != nil {
		if errors.Is(err, syscall.ELOOP) {
			return c.fail("provider_error", path+": too many levels of symbolic links")
		}
		return failPath(c, err, path)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return failPath(c, err, path)
	}
	if st.IsDir() {
		return c.fail("is_a_directory", path+" is a directory")
	}
	if !st.Mode().IsRegular() {
		// A FIFO or a device may never end (or never start): not a file to read.
		return c.fail("invalid_argument", path+" is not a regular file; read it with exec")
	}
	if st.Size() > limit {
		return c.fail("output_limit_exceeded",
			path+" is "+strconv.FormatInt(st.Size(), 10)+" bytes, over the read limit of "+
				strconv.FormatInt(limit, 10)+" bytes")
	}
	if boolean(h, "fd") {
		// The host reads the file itself, through this descriptor.
		return c.sendFd(header{"t": "fd", "size": st.Size()}, f)
	}
	buf := make([]byte, chunkSize)
	var sent int64
	for {
		n, err := f.Read(buf)
		if n > 0 {
			sent += int64(n)
			if sent > limit {
				return c.fail("output_limit_exceeded",
					path+" is over the read limit of "+strconv.FormatInt(limit, 10)+" bytes")
			}
			if e := c.send(header{"t": "data"}, buf[:n]); e != nil {
				return e
			}
		}
		if err == io.EOF {
			break
		}
		if err != nil {
			return failPath(c, err, path)
		}
	}
	return c.send(header{"t": "end"}, nil)
}

// resolveForWrite follows links at path to the file a write lands in, as
// open() would; an existing target's mode and owner are kept.
func resolveForWrite(path string) (string, fs.FileInfo, error) {
	target := path
	for hop := 0; hop < 40; hop++ {
		st, err := os.Lstat(target)
		if err != nil {
			if errors.Is(err, fs.ErrNotExist) {
				return target, nil, nil
			}
			return "", nil, err
		}
		if st.Mode()&fs.ModeSymlink == 0 {
			return target, st, nil
		}
		link, err := os.Readlink(target)
		if err != nil {
			return "", nil, err
		}
		if !filepath.IsAbs(link) {
			link = filepath.Join(filepath.Dir(target), link)
		}
		target = link
	}
	return "", nil, syscall.ELOOP
}

func handleWrite(c *conn, h header) error {
	path := str(h, "path")
	// The content follows as "in" frames, then "eof"; read it all even when
	// the write cannot happen, so the connection stays in step.
	var failure func() error
	fail := func(f func() error) {
		if failure == nil {
			failure = f
		}
	}
	target, existing, err := resolveForWrite(path)
	var tmp *os.File
	if err != nil {
		fail(func() error { return failPath(c, err, path) })
	} else if existing != nil && existing.IsDir() {
		fail(func() error { return c.fail("is_a_directory", path+" is a directory") })
	} else {
		dir := filepath.Dir(target)
		if err := os.MkdirAll(dir, 0o755); err != nil {
			if errCode(err) == "provider_error" || errors.Is(err, syscall.ENOTDIR) {
				fail(func() error { return c.fail("file_not_found", "a parent of "+path+" is not a directory") })
			} else {
				fail(func() error { return failPath(c, err, path) })
			}
		} else {
			tmp, err = os.CreateTemp(dir, writeTempPrefix+"*")
			if err != nil {
				fail(func() error { return failPath(c, err, path) })
			}
		}
	}
	if boolean(h, "fd") {
		// The host writes the content itself, through the temporary file's
		// descriptor, then says "eof"; a write that cannot happen is
		// refused at once.
		if failure != nil {
			if tmp != nil {
				tmp.Close()
				os.Remove(tmp.Name())
			}
			return failure()
		}
		if err := c.sendFd(header{"t": "fd"}, tmp); err != nil {
			tmp.Close()
			os.Remove(tmp.Name())
			return err
		}
	}
	for {
		fh, payload, err := c.readFrame()
		if err != nil {
			if tmp != nil {
				tmp.Close()
				os.Remove(tmp.Name())
			}
			return err
		}
		if str(fh, "t") == "eof" {
			break
		}
		if tmp != nil && failure == nil {
			if _, err := tmp.Write(payload); err != nil {
				fail(func() error { return failPath(c, err, path) })
			}
		}
	}
	if tmp == nil {
		return failure()
	}
	mode := fs.FileMode(0o644)
	if existing != nil {
		mode = existing.Mode().Perm() | existing.Mode()&(fs.ModeSetuid|fs.ModeSetgid|fs.ModeSticky)
		if sys, ok := existing.Sys().(*syscall.Stat_t); ok {
			_ = tmp.Chown(int(sys.Uid), int(sys.Gid))
		}
	}
	if failure == nil {
		if err := tmp.Chmod(mode); err != nil {
			fail(func() error { return failPath(c, err, path) })
		}
	}
	closeErr := tmp.Close()
	if failure == nil && closeErr != nil {
		fail(func() error { return failPath(c, closeErr, path) })
	}
	if failure == nil {
		if err := os.Rename(tmp.Name(), target); err != nil {
			fail(func() error { return failPath(c, err, path) })
		}
	}
	if failure != nil {
		os.Remove(tmp.Name())
		return failure()
	}
	return c.send(header{"t": "ok"}, nil)
}

func handleList(c *conn, h header) error {
	path := str(h, "path")
	st, err := os.Stat(path)
	if err != nil {
		return failPath(c, err, path)
	}
	if !st.IsDir() {
		return c.fail("invalid_argument", path+" is not a directory")
	}
	entries, err := os.ReadDir(path)
	if err != nil {
		return failPath(c, err, path)
	}
	base := path
	for len(base) > 1 && base[len(base)-1] == '/' {
		base = base[:len(base)-1]
	}
	if base == "/" {
		base = ""
	}
	items := make([]interface{}, 0, len(entries))
	for _, e := range entries {
		info, err := os.Lstat(base + "/" + e.Name())
		if err != nil {
			continue
		}
		items = append(items, statHeader(base+"/"+e.Name(), info))
	}
	sort.Slice(items, func(i, j int) bool {
		return items[i].(header)["path"].(string) < items[j].(header)["path"].(string)
	})
	return c.send(header{"t": "ok", "entries": items}, nil)
}

func handleRemove(c *conn, h header) error {
	path := str(h, "path")
	st, err := os.Lstat(path)
	if err != nil {
		return failPath(c, err, path)
	}
	if st.IsDir() {
		if boolean(h, "recursive") {
			err = os.RemoveAll(path)
		} else {
			err = syscall.Rmdir(path)
			if err == syscall.ENOTEMPTY || err == syscall.EEXIST {
				return c.fail("is_a_directory", path+" is a non-empty directory; pass recursive=True")
			}
		}
	} else {
		err = syscall.Unlink(path)
	}
	if err != nil {
		return failPath(c, err, path)
	}
	return c.send(header{"t": "ok"}, nil)
}

// treeCode: the error code of a failed mkdir or rename, where they differ
// from the other operations' (a file where a directory must be, something
// in the way, a directory into itself, two file systems).
func treeCode(err error) (string, string) {
	var errno syscall.Errno
	if errors.As(err, &errno) {
		switch errno {
		case syscall.ENOTDIR:
			return "not_a_directory", "a file is where a directory must be"
		case syscall.EEXIST, syscall.ENOTEMPTY:
			return "file_exists", "something is already there"
		case syscall.EINVAL:
			return "invalid_argument", "cannot move a directory into itself"
		case syscall.EXDEV:
			return "cross_device", "cannot rename across file systems (or a directory of an overlay's lower layer)"
		}
	}
	return "", ""
}

func failTree(c *conn, err error, path string) error {
	if code, msg := treeCode(err); code != "" {
		return c.fail(code, path+": "+msg)
	}
	return failPath(c, err, path)
}

// handleMkdir: the directory path (0755, whatever the umask), and its
// missing parents when asked.
func handleMkdir(c *conn, h header) error {
	path := str(h, "path")
	var err error
	if boolean(h, "parents") {
		if _, statErr := os.Lstat(path); statErr == nil {
			err = syscall.EEXIST
		} else {
			err = os.MkdirAll(path, 0o755)
		}
	} else {
		err = syscall.Mkdir(path, 0o755)
	}
	if err == nil {
		err = os.Chmod(path, 0o755)
	}
	if err != nil {
		return failTree(c, err, path)
	}
	return c.send(header{"t": "ok"}, nil)
}

// handleRename: rename(2), replacing a file or an empty directory.
func handleRename(c *conn, h header) error {
	src, dst := str(h, "src"), str(h, "dst")
	if err := syscall.Rename(src, dst); err != nil {
		return failTree(c, err, src+" -> "+dst)
	}
	return c.send(header{"t": "ok"}, nil)
}

// walk calls visit with every regular file below root, and every link to
// one: never a FIFO, device or socket (a read of one may never end).
// Directories are entered (links to them are not), the root followed if it
// is a link.
func walk(root string, visit func(string) error) error {
	st, err := os.Stat(root)
	if err != nil {
		return err
	}
	if !st.IsDir() {
		return nil
	}
	base := root
	for len(base) > 1 && base[len(base)-1] == '/' {
		base = base[:len(base)-1]
	}
	if base == "/" {
		base = ""
	}
	var descend func(dir string) error
	descend = func(dir string) error {
		listed := dir
		if listed == "" {
			listed = "/"
		}
		entries, err := os.ReadDir(listed)
		if err != nil {
			return nil // os.walk skips what it cannot list
		}
		for _, e := range entries {
			full := dir + "/" + e.Name()
			kind := e.Type()
			if kind.IsDir() {
				if err := descend(full); err != nil {
					return err
				}
				continue
			}
			if kind&fs.ModeSymlink != 0 {
				if target, err := os.Stat(full); err != nil || !target.Mode().IsRegular() {
					continue
				}
			} else if !kind.IsRegular() {
				continue
			}
			if err := visit(full); err != nil {
				return err
			}
		}
		return nil
	}
	return descend(base)
}

// batcher sends NUL-separated paths in frames of up to a chunk.
type batcher struct {
	c   *conn
	buf []byte
}

func (b *batcher) add(path string) error {
	if len(b.buf)+len(path)+1 > chunkSize {
		if err := b.flush(); err != nil {
			return err
		}
	}
	b.buf = append(b.buf, path...)
	b.buf = append(b.buf, 0)
	return nil
}

func (b *batcher) flush() error {
	if len(b.buf) == 0 {
		return nil
	}
	err := b.c.send(header{"t": "data"}, b.buf)
	b.buf = b.buf[:0]
	return err
}

// handleWalk sends every path below root, a chunk at a time, with a
// heartbeat every second while it walks (see beatWhile).
func handleWalk(c *conn, h header) error {
	root := str(h, "root")
	b := &batcher{c: c}
	stop := beatWhile(c, heartbeatEvery)
	err := walk(root, b.add)
	stop()
	if err != nil {
		if _, ok := err.(*fs.PathError); ok {
			return failPath(c, err, root)
		}
		return err
	}
	if err := b.flush(); err != nil {
		return err
	}
	return c.send(header{"t": "end"}, nil)
}

// -- grep ---------------------------------------------------------------------

func foldASCII(b []byte) []byte {
	out := make([]byte, len(b))
	for i, ch := range b {
		if 'A' <= ch && ch <= 'Z' {
			ch += 'a' - 'A'
		}
		out[i] = ch
	}
	return out
}

// handleGrep sends every text file (no NUL in its first 8 KiB) below root,
// whose name matches name, that holds one of literals (any file when
// there are none): the host matches its lines by its own rule. Files over a
// chunk are named for the host to read itself; unreadable ones are skipped.
func handleGrep(c *conn, h header) error {
	root := str(h, "root")
	name := str(h, "name")
	icase := boolean(h, "icase")
	literalStrs, _ := strList(h, "literals")
	literals := make([][]byte, 0, len(literalStrs))
	for _, l := range literalStrs {
		if icase {
			literals = append(literals, foldASCII([]byte(l)))
		} else {
			literals = append(literals, []byte(l))
		}
	}
	st, err := os.Stat(root)
	if err != nil {
		return failPath(c, err, root)
	}
	// Files are read by a few workers at once (the tree walk feeds them), each
	// with raw system calls into a buffer of its own: no poller, no per-file
	// allocation. The host sorts what it gets.
	paths := make(chan string, 256)
	var sendErr error
	var errMu sync.Mutex
	setErr := func(err error) {
		errMu.Lock()
		if sendErr == nil {
			sendErr = err
		}
		errMu.Unlock()
	}
	check := func(path string, buf []byte) []byte {
		if name != "" {
			if ok, _ := filepath.Match(name, filepath.Base(path)); !ok {
				return buf
			}
		}
		fd, err := syscall.Open(path, syscall.O_RDONLY|syscall.O_NONBLOCK|syscall.O_CLOEXEC, 0)
		if err != nil {
			return buf
		}
		defer syscall.Close(fd)
		var st syscall.Stat_t
		if syscall.Fstat(fd, &st) != nil || st.Mode&syscall.S_IFMT != syscall.S_IFREG {
			return buf
		}
		if st.Size > chunkSize {
			if err := c.send(header{"t": "big", "path": path}, nil); err != nil {
				setErr(err)
			}
			return buf
		}
		n := 0
		for {
			if n == len(buf) {
				if len(buf) > chunkSize {
					if err := c.send(header{"t": "big", "path": path}, nil); err != nil {
						setErr(err)
					}
					return buf
				}
				buf = append(buf, make([]byte, len(buf))...)
			}
			m, err := syscall.Read(fd, buf[n:])
			if err == syscall.EINTR {
				continue
			}
			if err != nil {
				return buf
			}
			if m == 0 {
				break
			}
			n += m
		}
		data := buf[:n]
		head := data
		if len(head) > 8192 {
			head = head[:8192]
		}
		if bytes.IndexByte(head, 0) >= 0 {
			return buf
		}
		if len(literals) > 0 {
			hay := data
			if icase {
				hay = foldASCII(data)
			}
			found := false
			for _, l := range literals {
				if bytes.Contains(hay, l) {
					found = true
					break
				}
			}
			if !found {
				return buf
			}
		}
		if err := c.send(header{"t": "file", "path": path}, data); err != nil {
			setErr(err)
		}
		return buf
	}
	var workers sync.WaitGroup
	for i := 0; i < 4; i++ {
		workers.Add(1)
		go func() {
			defer workers.Done()
			buf := make([]byte, 64<<10)
			for p := range paths {
				buf = check(p, buf)
			}
		}()
	}
	feed := func(p string) error {
		errMu.Lock()
		err := sendErr
		errMu.Unlock()
		if err != nil {
			return err
		}
		paths <- p
		return nil
	}
	stop := beatWhile(c, heartbeatEvery) // between files, and within a slow one
	if st.IsDir() {
		err = walk(root, feed)
	} else {
		name = ""
		err = feed(root)
	}
	close(paths)
	workers.Wait()
	stop()
	if err == nil {
		err = sendErr
	}
	if err != nil {
		return err
	}
	return c.send(header{"t": "end"}, nil)
}
