package server

import "testing"

// The wake-up sweep's tests of the waker's echo bookkeeping (notify.go):
// a discovery round of this replica ignores its own NOTIFY outbox_wakeup
// when it comes back on the LISTEN connection, and must ignore nothing
// else: a wake-up from the same backend that is not the round's own (an
// operator's action or another round that ran there later, the pool's
// connections serve them all) is work announced, and ignoring it leaves
// that work to the poll.

// connectedWaker is a waker whose LISTEN connection is up.
func connectedWaker() *waker {
	w := newWaker(&Server{})
	w.listening(true)
	return w
}

// A round that made nothing ready (it committed no NOTIFY) expects no
// echo: the next wake-up from its backend is someone else's and is acted
// on. (Kills N11.)
func TestARoundThatDidNotNotifyExpectsNoEcho(t *testing.T) {
	w := connectedWaker()
	w.openRound(7)
	if seen := w.closeRound(7, false); seen {
		t.Fatal("a round that saw no wake-up reports one")
	}
	if w.echo(7) {
		t.Fatal("a wake-up from the backend of a round that did not notify was taken for its echo")
	}
}

// A wake-up that arrives while the round is open is the round's (taken as
// its echo, and reported by closeRound for the caller to act on if the
// round did not notify); once seen, no further echo is expected, so the
// next wake-up from that backend is acted on. (Kills N12, N15, N16.)
func TestAnEchoSeenWhileTheRoundIsOpenIsNotExpectedAgain(t *testing.T) {
	w := connectedWaker()
	w.openRound(7)
	if !w.echo(7) {
		t.Fatal("a wake-up from the backend of an open round was not taken for its own")
	}
	if seen := w.closeRound(7, true); !seen {
		t.Fatal("closeRound did not report the wake-up seen while the round was open")
	}
	if w.echo(7) {
		t.Fatal("the echo came while the round was open, and a later wake-up from its backend was taken for it too")
	}

	w.openRound(8)
	w.echo(8)
	if seen := w.closeRound(8, false); !seen {
		t.Fatal("a round that did not notify saw a wake-up from its backend, and closeRound did not report it for the caller to act on")
	}
}

// An echo expected after its round ended is taken once: the wake-up after
// it from the same backend is acted on. A backend no round of this replica
// ran on sends no echo. (Kills N17, N18.)
func TestAnExpectedEchoIsTakenOnce(t *testing.T) {
	w := connectedWaker()
	if w.echo(9) {
		t.Fatal("a wake-up from a backend no local round ran on was taken for an echo")
	}
	w.openRound(7)
	w.closeRound(7, true)
	if !w.echo(7) {
		t.Fatal("the echo of a round that notified was not taken for its own")
	}
	if w.echo(7) {
		t.Fatal("a second wake-up from the backend of a round that notified once was taken for its echo too")
	}
}

// Echoes expected on a LISTEN connection that was lost will not come on
// the next: a wake-up from the same backend on the new connection is
// acted on, whether the round ended before the loss or during it.
// (Kills N14, N20, N21.)
func TestEchoesOfALostConnectionAreNotExpectedOnTheNext(t *testing.T) {
	w := connectedWaker()
	w.openRound(7)
	w.closeRound(7, true) // expected on this connection
	w.listening(false)
	w.listening(true)
	if w.echo(7) {
		t.Fatal("an echo expected on a lost connection swallowed a wake-up on the next")
	}

	w.openRound(8) // opened on this connection
	w.listening(false)
	w.listening(true)
	w.closeRound(8, true) // ends on the next
	if w.echo(8) {
		t.Fatal("a round opened on a lost connection expects its echo on the next, and swallowed a wake-up there")
	}
}
