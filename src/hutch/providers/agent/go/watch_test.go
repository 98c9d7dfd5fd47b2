package main

import (
	"encoding/binary"
	"reflect"
	"syscall"
	"testing"
)

// rawEvent encodes one inotify event as the kernel's read gives it.
func rawEvent(wd int32, mask, cookie uint32, name string) []byte {
	padded := (len(name) + 1 + 15) / 16 * 16
	b := make([]byte, syscall.SizeofInotifyEvent+padded)
	binary.LittleEndian.PutUint32(b[0:], uint32(wd))
	binary.LittleEndian.PutUint32(b[4:], mask)
	binary.LittleEndian.PutUint32(b[8:], cookie)
	binary.LittleEndian.PutUint32(b[12:], uint32(padded))
	copy(b[syscall.SizeofInotifyEvent:], name)
	return b
}

func reads(events ...[]byte) []byte {
	var out []byte
	for _, e := range events {
		out = append(out, e...)
	}
	return out
}

func translated(t *testing.T, w *treeWatch, buf []byte) []header {
	t.Helper()
	out, err := w.translate(buf)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// The kernel queues a rename's IN_MOVED_FROM and IN_MOVED_TO one after the
// other; a read between them gets the first alone. Seen in CI (kubernetes'
// watch_pairs_a_rename, a loaded machine): told as removed and created.
func TestARenameReadInTwoHalvesIsOneRename(t *testing.T) {
	w := &treeWatch{root: "/w", recursive: true, dirs: map[int32]string{1: "/w", 2: "/w/d"}}
	if got := translated(t, w, reads(rawEvent(1, syscall.IN_CREATE, 0, "a"),
		rawEvent(1, syscall.IN_MOVED_FROM, 5, "before"))); got != nil {
		t.Fatalf("a batch with half a rename was told at once: %v", got)
	}
	if !w.awaitingRenameHalf() {
		t.Fatal("not awaiting the rename's other half")
	}
	got := translated(t, w, reads(rawEvent(1, syscall.IN_MOVED_TO, 5, "after"),
		rawEvent(1, syscall.IN_MODIFY, 0, "after")))
	want := []header{{"k": "created", "p": "/w/a"}, {"k": "renamed", "p": "/w/before", "n": "/w/after"},
		{"k": "written", "p": "/w/after"}}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("got %v, want %v", got, want)
	}
	if w.awaitingRenameHalf() || w.flush() != nil {
		t.Fatal("something still held")
	}
	// A directory's rename, so split, moves its watches with it.
	translated(t, w, rawEvent(1, syscall.IN_MOVED_FROM|syscall.IN_ISDIR, 6, "d"))
	got = translated(t, w, rawEvent(1, syscall.IN_MOVED_TO|syscall.IN_ISDIR, 6, "e"))
	if !reflect.DeepEqual(got, []header{{"k": "renamed", "p": "/w/d", "n": "/w/e"}}) || w.dirs[2] != "/w/e" {
		t.Fatalf("got %v, dirs %v", got, w.dirs)
	}
}

// A half whose other half never comes was a move out of the tree: flush
// tells the held batch, in order, with it a removal; an agent's own
// temporary file moved away is told not at all.
func TestAnUnpairedHalfIsToldAtFlushAsARemoval(t *testing.T) {
	w := &treeWatch{root: "/w", dirs: map[int32]string{1: "/w"}}
	got := translated(t, w, reads(rawEvent(1, syscall.IN_MOVED_FROM, 7, "out"),
		rawEvent(1, syscall.IN_MOVED_FROM, 8, writeTempPrefix+"x"),
		rawEvent(1, syscall.IN_MOVED_TO, 9, "in")))
	if got != nil {
		t.Fatalf("told at once: %v", got)
	}
	want := []header{{"k": "removed", "p": "/w/out"}, {"k": "created", "p": "/w/in"}}
	if got := w.flush(); !reflect.DeepEqual(got, want) {
		t.Fatalf("got %v, want %v", got, want)
	}
	if w.awaitingRenameHalf() {
		t.Fatal("still awaiting after flush")
	}
	// The agent's write put in place, its halves in two reads: created, written.
	translated(t, w, rawEvent(1, syscall.IN_MOVED_FROM, 10, writeTempPrefix+"y"))
	got = translated(t, w, rawEvent(1, syscall.IN_MOVED_TO, 10, "file"))
	if !reflect.DeepEqual(got, []header{{"k": "created", "p": "/w/file"}, {"k": "written", "p": "/w/file"}}) {
		t.Fatalf("got %v", got)
	}
}
