package transporttest

import (
	"context"
	"errors"
	"net"
	"sync"
	"time"
)

// Network is the path between a case's clients and its broker. A [Broker]
// dials every connection of its writers and readers through the [Link] it
// is given, so that the suite can freeze one client (a paused process) and
// a broker without a real restart can model one by cutting every
// connection ([Network.Cut]).
type Network struct {
	mu    sync.Mutex
	links []*Link
}

// NewNetwork returns a network with no links.
func NewNetwork() *Network { return &Network{} }

// Link returns a new link on n.
func (n *Network) Link() *Link {
	l := &Link{conns: map[*linkConn]struct{}{}}
	l.cond = sync.NewCond(&l.mu)
	n.mu.Lock()
	n.links = append(n.links, l)
	n.mu.Unlock()
	return l
}

// Cut closes every connection of every link and refuses new ones for down:
// what clients see of a broker that crashed and came back after down.
func (n *Network) Cut(down time.Duration) {
	n.mu.Lock()
	links := append([]*Link(nil), n.links...)
	n.mu.Unlock()
	for _, l := range links {
		l.cut(down)
	}
}

// Link is one client's connections to the broker.
type Link struct {
	mu        sync.Mutex
	cond      *sync.Cond
	frozen    bool
	downUntil time.Time
	conns     map[*linkConn]struct{}
}

// errLinkDown is what a dial gets while its network is cut.
var errLinkDown = errors.New("transporttest: link is down (the broker is being restarted)")

// DialContext dials address through the link, as kafka.Dialer.DialFunc.
func (l *Link) DialContext(ctx context.Context, network, address string) (net.Conn, error) {
	l.mu.Lock()
	down := time.Now().Before(l.downUntil)
	l.mu.Unlock()
	if down {
		return nil, &net.OpError{Op: "dial", Net: network, Err: errLinkDown}
	}
	var d net.Dialer
	c, err := d.DialContext(ctx, network, address)
	if err != nil {
		return nil, err
	}
	lc := &linkConn{Conn: c, l: l}
	l.mu.Lock()
	l.conns[lc] = struct{}{}
	l.mu.Unlock()
	return lc, nil
}

// Dial dials address through the link, as nats.CustomDialer.
func (l *Link) Dial(network, address string) (net.Conn, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	return l.DialContext(ctx, network, address)
}

// Freeze stops every byte on the link's connections, both ways, until
// Thaw: the client looks to the broker like a process that hangs.
func (l *Link) Freeze() {
	l.mu.Lock()
	l.frozen = true
	l.mu.Unlock()
}

// Thaw lets the link's connections move again.
func (l *Link) Thaw() {
	l.mu.Lock()
	l.frozen = false
	l.cond.Broadcast()
	l.mu.Unlock()
}

func (l *Link) cut(down time.Duration) {
	l.mu.Lock()
	l.downUntil = time.Now().Add(down)
	conns := make([]*linkConn, 0, len(l.conns))
	for c := range l.conns {
		conns = append(conns, c)
	}
	l.mu.Unlock()
	for _, c := range conns {
		_ = c.Close()
	}
}

// wait blocks while the link is frozen and c open.
func (l *Link) wait(c *linkConn) {
	l.mu.Lock()
	for l.frozen && !c.closed {
		l.cond.Wait()
	}
	l.mu.Unlock()
}

type linkConn struct {
	net.Conn
	l      *Link
	closed bool // under l.mu
}

func (c *linkConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	c.l.wait(c) // what arrived while frozen is held until Thaw
	return n, err
}

func (c *linkConn) Write(p []byte) (int, error) {
	c.l.wait(c)
	return c.Conn.Write(p)
}

func (c *linkConn) Close() error {
	c.l.mu.Lock()
	c.closed = true
	delete(c.l.conns, c)
	c.l.cond.Broadcast()
	c.l.mu.Unlock()
	return c.Conn.Close()
}
