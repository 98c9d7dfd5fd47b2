package main

import (
	"net"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"
)

// answerFrames runs handle on one end of a connection and gathers the
// frames it sends on the other, up to its "end" (or its error).
func answerFrames(t *testing.T, handle func(c *conn) error) []header {
	t.Helper()
	here, there := net.Pipe()
	defer here.Close()
	done := make(chan error, 1)
	go func() {
		defer there.Close()
		done <- handle(&conn{r: there, w: there})
	}()
	reader := &conn{r: here, w: here}
	var frames []header
	for {
		h, _, err := reader.readFrame()
		if err != nil {
			t.Fatalf("reading the answer: %v (after %d frames)", err, len(frames))
		}
		frames = append(frames, h)
		if h["t"] == "end" || h["t"] == "err" {
			break
		}
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	return frames
}

func count(frames []header, kind string) int {
	n := 0
	for _, f := range frames {
		if f["t"] == kind {
			n++
		}
	}
	return n
}

// A grep or a walk that finds nothing for long still says the agent is
// alive, by the clock and not by its progress: the host gives up on an
// agent silent for 3 s. A grep whose name filter lets nothing through (or
// one waiting on a slow read) went silent until its end, and the host said
// the agent had failed (CI: a docker grep of /proc, answered 502 within its
// 5 s timeout).
func TestALongGrepOrWalkThatFindsNothingBeats(t *testing.T) {
	dir := t.TempDir()
	for i := 0; i < 300; i++ {
		sub := filepath.Join(dir, strconv.Itoa(i))
		if err := os.Mkdir(sub, 0o755); err != nil {
			t.Fatal(err)
		}
		for j := 0; j < 20; j++ {
			if err := os.WriteFile(filepath.Join(sub, strconv.Itoa(j)+".txt"), []byte("hay\n"), 0o644); err != nil {
				t.Fatal(err)
			}
		}
	}
	saved := heartbeatEvery
	heartbeatEvery = time.Millisecond
	defer func() { heartbeatEvery = saved }()
	grep := answerFrames(t, func(c *conn) error {
		return handleGrep(c, header{"root": dir, "name": "*.none", "literals": []interface{}{"needle"}})
	})
	if count(grep, "file")+count(grep, "big") != 0 || count(grep, "hb") < 2 {
		t.Fatalf("a grep that finds nothing sent %d frames, %d of them heartbeats", len(grep), count(grep, "hb"))
	}
	walked := answerFrames(t, func(c *conn) error {
		return handleWalk(c, header{"root": dir})
	})
	if count(walked, "hb") < 2 {
		t.Fatalf("a walk sent %d frames, %d of them heartbeats", len(walked), count(walked, "hb"))
	}
}
