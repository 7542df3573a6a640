package sink_test

import (
	"bytes"
	"io"
	"net"
	"sync"
	"testing"
)

// proxy forwards loopback TCP connections to a broker, so that a test can
// cut them (as a broker restart or a network fault would), stall either
// direction, lose the next reply, or hold the broker's answers from a
// chosen NATS publish on until it lets them go, each at an explicit signal
// rather than after a sleep.
type proxy struct {
	l     net.Listener
	mu    sync.Mutex
	conns []net.Conn
	stall chan struct{} // while non-nil, nothing is forwarded to the client
	// upHeld, while non-nil, stops reading what the client sends.
	upHeld chan struct{}
	// dropReply, when set, makes the next bytes from the server to the
	// client cut every connection instead of being forwarded: the request
	// was carried out, and its answer is lost.
	dropReply bool
	// NATS publishes (HPUB: the sink's messages always carry headers).
	pubs    int           // HPUBs seen going up
	holdAt  int           // stall once pubs reaches it (0: not armed)
	answer  []byte        // what the held answer to that publish contains
	pubHeld chan struct{} // closed once the armed publish went up
	ansHeld chan struct{} // closed once that answer is held here
	sawEnd  chan struct{} // closed once the client sent UNSUB or hung up
	pubOnce sync.Once
	ansOnce sync.Once
	endOnce sync.Once
	wg      sync.WaitGroup
}

func newProxy(t *testing.T, target string) *proxy {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &proxy{l: l, pubHeld: make(chan struct{}), ansHeld: make(chan struct{}), sawEnd: make(chan struct{})}
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			up, err := net.Dial("tcp", target)
			if err != nil {
				c.Close()
				continue
			}
			// A fixed receive buffer (no autotuning): what the client
			// can write while the proxy stops reading stays small.
			_ = c.(*net.TCPConn).SetReadBuffer(128 << 10)
			p.mu.Lock()
			p.conns = append(p.conns, c, up)
			p.mu.Unlock()
			p.wg.Add(2)
			go func() { defer p.wg.Done(); p.copyUp(up, c); up.Close() }()
			go func() { defer p.wg.Done(); p.copyDown(c, up); c.Close() }()
		}
	}()
	t.Cleanup(func() { l.Close(); p.release(); p.cut(); p.wg.Wait() })
	return p
}

func (p *proxy) copyUp(dst, src net.Conn) {
	buf := make([]byte, 32<<10)
	for {
		p.mu.Lock()
		upHeld := p.upHeld
		p.mu.Unlock()
		if upHeld != nil {
			<-upHeld
		}
		n, err := src.Read(buf)
		if n > 0 {
			p.mu.Lock()
			p.pubs += bytes.Count(buf[:n], []byte("HPUB "))
			reached := p.holdAt > 0 && p.pubs >= p.holdAt
			if reached {
				// Before the publish goes up, so its answer is held.
				p.stall, p.holdAt = make(chan struct{}), 0
			}
			p.mu.Unlock()
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
			if reached {
				p.pubOnce.Do(func() { close(p.pubHeld) })
			}
			if bytes.Contains(buf[:n], []byte("UNSUB ")) {
				p.endOnce.Do(func() { close(p.sawEnd) })
			}
		}
		if err != nil {
			if err == io.EOF {
				p.endOnce.Do(func() { close(p.sawEnd) })
			}
			return
		}
	}
}

func (p *proxy) copyDown(dst, src net.Conn) {
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			p.mu.Lock()
			stall, drop, answer := p.stall, p.dropReply, p.answer
			p.dropReply = false
			p.mu.Unlock()
			if drop {
				p.cut()
				return
			}
			if stall != nil {
				if answer != nil && bytes.Contains(buf[:n], answer) {
					p.ansOnce.Do(func() { close(p.ansHeld) })
				}
				<-stall
			}
			if _, err := dst.Write(buf[:n]); err != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

// cut closes every connection through the proxy.
func (p *proxy) cut() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, c := range p.conns {
		c.Close()
	}
	p.conns = nil
}

// loseNextReply arms dropReply.
func (p *proxy) loseNextReply() {
	p.mu.Lock()
	p.dropReply = true
	p.mu.Unlock()
}

// pause stops forwarding what the server sends until resume.
func (p *proxy) pause() {
	p.mu.Lock()
	p.stall = make(chan struct{})
	p.mu.Unlock()
}

func (p *proxy) resume() {
	p.mu.Lock()
	if p.stall != nil {
		close(p.stall)
		p.stall = nil
	}
	p.mu.Unlock()
}

// holdAtPub arms the proxy: the n-th NATS publish from now is let through,
// and everything the server sends from then on is held until release;
// ansHeld is closed once a held chunk contains answer, the server's
// answer to that publish (the server had handled it, then).
func (p *proxy) holdAtPub(n int, answer string) {
	p.mu.Lock()
	p.holdAt, p.answer = p.pubs+n, []byte(answer)
	p.mu.Unlock()
}

// stallUp stops reading what the client sends, as a broker that stops
// reading (RabbitMQ's resource alarms block publishers so) would, until
// release.
func (p *proxy) stallUp() {
	p.mu.Lock()
	p.upHeld = make(chan struct{})
	p.mu.Unlock()
}

// release lets both directions go on.
func (p *proxy) release() {
	p.resume()
	p.mu.Lock()
	if p.upHeld != nil {
		close(p.upHeld)
		p.upHeld = nil
	}
	p.mu.Unlock()
}
