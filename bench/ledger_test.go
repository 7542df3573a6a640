package bench

import (
	"sync"
	"testing"
	"time"
)

// commitAll commits revisions 1..n of agg at times 1..n.
func commitAll(t *testing.T, l *Ledger, agg int, n int64) {
	t.Helper()
	for rev := int64(1); rev <= n; rev++ {
		if err := l.Commit(agg, rev, rev); err != nil {
			t.Fatal(err)
		}
	}
}

func deliver(t *testing.T, l *Ledger, agg int, rev int64, producer int, seq int64) Delivery {
	t.Helper()
	d, err := l.Deliver(agg, rev, producer, seq, 100+rev)
	if err != nil {
		t.Fatal(err)
	}
	return d
}

func recordDB(t *testing.T, l *Ledger, agg int, rev int64, published bool) {
	t.Helper()
	var at int64
	if published {
		at = 1000 + rev
	}
	if err := l.RecordDB(agg, rev, at); err != nil {
		t.Fatal(err)
	}
}

func TestLedgerInOrderDeliveryIsClean(t *testing.T) {
	l := NewLedger(2, 1)
	commitAll(t, l, 0, 3)
	commitAll(t, l, 1, 2)
	for rev := int64(1); rev <= 3; rev++ {
		if d := deliver(t, l, 0, rev, -1, 0); d != FirstDelivery {
			t.Fatalf("revision %d: %v, want FirstDelivery", rev, d)
		}
		recordDB(t, l, 0, rev, true)
	}
	// Aggregates are independent: aggregate 1 may go last.
	for rev := int64(1); rev <= 2; rev++ {
		deliver(t, l, 1, rev, -1, 0)
		recordDB(t, l, 1, rev, true)
	}
	l.MarkScanned()
	want := Counts{Committed: 5, Delivered: 5}
	if got := l.Counts(); got != want {
		t.Fatalf("counts %+v, want %+v", got, want)
	}
	if got := l.Counts(); got.Failed() {
		t.Fatal("a clean account reports failure")
	}
}

func TestLedgerCountsAnOvertakingEventOnce(t *testing.T) {
	l := NewLedger(1, 1)
	commitAll(t, l, 0, 4)
	deliver(t, l, 0, 1, -1, 0)
	if d := deliver(t, l, 0, 3, -1, 0); d != ReorderedDelivery {
		t.Fatalf("revision 3 before 2: %v, want ReorderedDelivery", d)
	}
	// Revision 2 arrives late; it is not itself out of order, and 4 after
	// it is in order again.
	if d := deliver(t, l, 0, 2, -1, 0); d != FirstDelivery {
		t.Fatalf("revision 2: %v, want FirstDelivery", d)
	}
	if d := deliver(t, l, 0, 4, -1, 0); d != FirstDelivery {
		t.Fatalf("revision 4: %v, want FirstDelivery", d)
	}
	c := l.Counts()
	if c.Reordered != 1 || c.Delivered != 4 || !c.Failed() {
		t.Fatalf("counts %+v, want 1 reordered of 4 delivered, failed", c)
	}
}

func TestLedgerProducerSequenceCatchesWhatRevisionsMiss(t *testing.T) {
	// Revisions arrive in order, but the payloads say producer 0 committed
	// them the other way round: the revisions are wrong, and the sink must
	// notice without trusting them.
	l := NewLedger(1, 2)
	commitAll(t, l, 0, 2)
	deliver(t, l, 0, 1, 0, 7)
	if d := deliver(t, l, 0, 2, 0, 5); d != ReorderedDelivery {
		t.Fatalf("an earlier sequence number after a later one: %v, want ReorderedDelivery", d)
	}
	// Another producer's sequence numbers are its own.
	l2 := NewLedger(1, 2)
	commitAll(t, l2, 0, 2)
	deliver(t, l2, 0, 1, 0, 7)
	if d := deliver(t, l2, 0, 2, 1, 5); d != FirstDelivery {
		t.Fatalf("another producer's event: %v, want FirstDelivery", d)
	}
}

func TestLedgerDuplicatesAreCountedNotFailed(t *testing.T) {
	l := NewLedger(1, 1)
	commitAll(t, l, 0, 2)
	deliver(t, l, 0, 1, 0, 1)
	deliver(t, l, 0, 2, 0, 2)
	// A redelivery of revision 1 after 2 is a duplicate, not a reorder (the
	// consumer deduplicates by event id), even though its sequence number
	// is behind.
	if d := deliver(t, l, 0, 1, 0, 1); d != DuplicateDelivery {
		t.Fatalf("repeat: %v, want DuplicateDelivery", d)
	}
	deliver(t, l, 0, 1, 0, 1)
	c := l.Counts()
	if c.Duplicates != 2 || c.Reordered != 0 || c.Delivered != 2 || c.Failed() {
		t.Fatalf("counts %+v, want 2 duplicates, nothing failed", c)
	}
	if l.Delivered() != 2 {
		t.Fatalf("Delivered() = %d, want 2 distinct events", l.Delivered())
	}
}

func TestLedgerLostBacklogAndUnacked(t *testing.T) {
	l := NewLedger(1, 1)
	commitAll(t, l, 0, 5)
	deliver(t, l, 0, 1, -1, 0)
	deliver(t, l, 0, 2, -1, 0)
	recordDB(t, l, 0, 1, true)
	recordDB(t, l, 0, 2, false) // delivered, ack not landed: unacked
	recordDB(t, l, 0, 3, true)  // published but never delivered: lost
	recordDB(t, l, 0, 4, false) // pending: backlog
	// revision 5 is not in the database at all: lost
	l.MarkScanned()
	c := l.Counts()
	want := Counts{Committed: 5, Delivered: 2, Lost: 2, Backlog: 1, Unacked: 1}
	if c != want {
		t.Fatalf("counts %+v, want %+v", c, want)
	}
	if !c.Failed() {
		t.Fatal("lost events must fail the account")
	}
}

func TestLedgerWithoutScanCountsUndeliveredAsBacklog(t *testing.T) {
	l := NewLedger(1, 1)
	commitAll(t, l, 0, 3)
	deliver(t, l, 0, 1, -1, 0)
	if c := l.Counts(); c.Backlog != 2 || c.Lost != 0 || c.Unacked != 0 {
		t.Fatalf("counts %+v: nothing proves undelivered events lost before the database is read", c)
	}
}

func TestLedgerUnexpectedDeliveryFails(t *testing.T) {
	l := NewLedger(1, 1)
	commitAll(t, l, 0, 1)
	deliver(t, l, 0, 1, -1, 0)
	deliver(t, l, 0, 2, -1, 0) // no producer committed revision 2
	c := l.Counts()
	if c.Unexpected != 1 || !c.Failed() {
		t.Fatalf("counts %+v, want 1 unexpected and a failure", c)
	}
}

func TestLedgerPrefill(t *testing.T) {
	l := NewLedger(3, 1)
	for agg := range 3 {
		if err := l.Prefill(agg, 10); err != nil {
			t.Fatal(err)
		}
	}
	if l.Committed() != 30 {
		t.Fatalf("Committed() = %d, want 30", l.Committed())
	}
	for rev := int64(1); rev <= 10; rev++ {
		deliver(t, l, 1, rev, -1, 0)
	}
	if c := l.Counts(); c.Delivered != 10 || c.Backlog != 20 || c.Reordered != 0 {
		t.Fatalf("counts %+v", c)
	}
}

func TestLedgerRejectsBadInput(t *testing.T) {
	l := NewLedger(2, 1)
	if err := l.Commit(2, 1, 0); err == nil {
		t.Error("aggregate out of range accepted")
	}
	if err := l.Commit(0, 0, 0); err == nil {
		t.Error("revision 0 accepted")
	}
	if err := l.Commit(0, 1, 0); err != nil {
		t.Fatal(err)
	}
	if err := l.Commit(0, 1, 0); err == nil {
		t.Error("the same revision committed twice without complaint")
	}
	if _, err := l.Deliver(-1, 1, 0, 1, 0); err == nil {
		t.Error("delivery of a negative aggregate accepted")
	}
}

func TestLedgerLatencies(t *testing.T) {
	ms := int64(time.Millisecond)
	l := NewLedger(1, 1)
	for rev, at := range []int64{10 * ms, 20 * ms, 30 * ms, 40 * ms} {
		if err := l.Commit(0, int64(rev+1), at); err != nil {
			t.Fatal(err)
		}
	}
	must := func(_ Delivery, err error) {
		if err != nil {
			t.Fatal(err)
		}
	}
	must(l.Deliver(0, 1, -1, 0, 12*ms)) // 2ms
	must(l.Deliver(0, 2, -1, 0, 25*ms)) // 5ms
	must(l.Deliver(0, 3, -1, 0, 29*ms)) // before the commit was noted: 0
	recordDB(t, l, 0, 1, false)
	if err := l.RecordDB(0, 2, 27*ms); err != nil { // published 7ms after commit
		t.Fatal(err)
	}
	// Window [15ms, 45ms): revisions 2, 3, 4; the run ends at 50ms.
	toSink, toPub, cs, cp := l.Latencies(15*ms, 45*ms, 50*ms)
	wantSink := map[time.Duration]bool{5 * time.Millisecond: true, 0: true, 10 * time.Millisecond: true}
	if len(toSink) != 3 || cs != 1 {
		t.Fatalf("toSink %v censored %d, want 3 samples with 1 censored", toSink, cs)
	}
	for _, d := range toSink {
		if !wantSink[d] {
			t.Fatalf("unexpected commit→sink sample %v in %v", d, toSink)
		}
	}
	if len(toPub) != 3 || cp != 2 {
		t.Fatalf("toPublished %v censored %d, want 3 samples with 2 censored", toPub, cp)
	}
}

func TestLedgerDeliverySpan(t *testing.T) {
	l := NewLedger(2, 1)
	if _, _, _, ok := l.DeliverySpan(); ok {
		t.Fatal("span of nothing")
	}
	commitAll(t, l, 0, 2)
	commitAll(t, l, 1, 1)
	for _, d := range []struct {
		agg int
		rev int64
		at  int64
	}{{0, 1, 50}, {1, 1, 20}, {0, 2, 90}} {
		if _, err := l.Deliver(d.agg, d.rev, -1, 0, d.at); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := l.Deliver(0, 2, -1, 0, 500); err != nil { // a duplicate does not move the end
		t.Fatal(err)
	}
	first, last, n, ok := l.DeliverySpan()
	if !ok || first != 20 || last != 90 || n != 3 {
		t.Fatalf("span %d..%d over %d (ok %v), want 20..90 over 3", first, last, n, ok)
	}
}

// Many producers and deliverers at once, as in a run: the account must come
// out exact (run with -race).
func TestLedgerConcurrentUse(t *testing.T) {
	const aggs, perAgg = 50, 40
	l := NewLedger(aggs, 1)
	var wg sync.WaitGroup
	for agg := range aggs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for rev := int64(1); rev <= perAgg; rev++ {
				if err := l.Commit(agg, rev, rev); err != nil {
					t.Error(err)
					return
				}
				if _, err := l.Deliver(agg, rev, 0, rev, rev); err != nil {
					t.Error(err)
					return
				}
			}
		}()
	}
	wg.Wait()
	c := l.Counts()
	if c.Committed != aggs*perAgg || c.Delivered != aggs*perAgg || c.Failed() || c.Duplicates != 0 {
		t.Fatalf("counts %+v", c)
	}
}

// An arm that deletes what it acked: a delivered event missing from the
// database was acked, an undelivered one was lost, and no commit→published
// latency is made up.
func TestLedgerAbsentAcked(t *testing.T) {
	l := NewLedger(1, 1)
	commitAll(t, l, 0, 3)
	deliver(t, l, 0, 1, -1, 0)
	deliver(t, l, 0, 2, -1, 0)
	recordDB(t, l, 0, 2, false) // delivered, its ack not landed: still in the table
	l.MarkAbsentAcked()
	l.MarkScanned()
	want := Counts{Committed: 3, Delivered: 2, Unacked: 1, Lost: 1}
	if got := l.Counts(); got != want {
		t.Fatalf("counts %+v, want %+v", got, want)
	}
	toSink, toPublished, _, _ := l.Latencies(0, 10, 1000)
	if len(toSink) != 3 || len(toPublished) != 0 {
		t.Fatalf("%d sink and %d published samples, want 3 and 0", len(toSink), len(toPublished))
	}
}

// A table that records a delivery without its time gives no
// commit→published sample for it.
func TestLedgerPublishedAtUnknown(t *testing.T) {
	l := NewLedger(1, 1)
	commitAll(t, l, 0, 2)
	deliver(t, l, 0, 1, -1, 0)
	if err := l.RecordDB(0, 1, publishedUnknown); err != nil {
		t.Fatal(err)
	}
	recordDB(t, l, 0, 2, false)
	l.MarkScanned()
	if got := l.Counts(); got.Unacked != 0 || got.Backlog != 1 || got.Failed() {
		t.Fatalf("counts %+v", got)
	}
	_, toPublished, _, censored := l.Latencies(0, 10, 1000)
	if len(toPublished) != 1 || censored != 1 {
		t.Fatalf("%d published samples (%d censored), want only the pending one", len(toPublished), censored)
	}
}
