package leasetoken

import (
	"bytes"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"errors"
	"fmt"
	"math"
	"sync"
	"testing"

	"github.com/google/uuid"
)

func signer(t testing.TB, b byte) *Signer {
	s, err := NewSigner(bytes.Repeat([]byte{b}, 32))
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func TestRoundTripAndForgery(t *testing.T) {
	s := signer(t, 1)
	tok := Token{EventID: uuid.New(), Epoch: 42, Aggregate: AggregateHash("orders", "order-7")}
	str := s.Sign(tok)
	got, err := s.Verify(str)
	if err != nil || got != tok {
		t.Fatalf("Verify(Sign(%v)) = %v, %v", tok, got, err)
	}
	if _, err := signer(t, 2).Verify(str); !errors.Is(err, ErrInvalid) {
		t.Fatalf("token verified under another key: %v", err)
	}
	// Flipping any byte of the token breaks it.
	for i := range len(str) {
		b := []byte(str)
		b[i] ^= 0x01
		if _, err := s.Verify(string(b)); err == nil {
			t.Fatalf("token with byte %d altered still verifies", i)
		}
	}
	if _, err := NewSigner([]byte("short")); err == nil {
		t.Fatal("short key accepted")
	}
}

func FuzzVerify(f *testing.F) {
	s := signer(f, 1)
	f.Add(s.Sign(Token{EventID: uuid.New(), Epoch: 1}))
	f.Add("")
	f.Add("AAAA")
	f.Fuzz(func(t *testing.T, token string) {
		got, err := s.Verify(token)
		if err != nil {
			return
		}
		// Anything that verifies must be exactly what was signed.
		if s.Sign(got) != token {
			t.Fatalf("verified token %q re-signs differently", token)
		}
	})
}

// A Signer reuses its keyed HMAC states: every token, signed one after
// another or at once on many goroutines, carries exactly the HMAC a fresh
// state computes, and verifies.
func TestReusedMACsMatchFreshOnes(t *testing.T) {
	key := bytes.Repeat([]byte{7}, 32)
	s, err := NewSigner(key)
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for g := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 200 {
				tok := Token{EventID: uuid.New(), Epoch: int64(g*1000 + i), Aggregate: uint32(i)}
				str := s.Sign(tok)
				raw, err := base64.RawURLEncoding.DecodeString(str)
				if err != nil {
					errs <- err
					return
				}
				m := hmac.New(sha256.New, key)
				m.Write(raw[:signed])
				if want := m.Sum(nil)[:macSize]; !bytes.Equal(raw[signed:], want) {
					errs <- fmt.Errorf("token %d of goroutine %d: mac %x, want %x", i, g, raw[signed:], want)
					return
				}
				if got, err := s.Verify(str); err != nil || got != tok {
					errs <- fmt.Errorf("Verify(Sign(%v)) = %v, %v", tok, got, err)
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
}

// NewSigner's documented floor is 32 bytes: a 31-byte key is refused and a
// 32-byte one accepted.
func TestNewSignerNeedsAKeyOfAtLeast32Bytes(t *testing.T) {
	if _, err := NewSigner(bytes.Repeat([]byte{1}, 31)); err == nil {
		t.Error("a 31-byte key accepted")
	}
	if _, err := NewSigner(bytes.Repeat([]byte{1}, 32)); err != nil {
		t.Errorf("a 32-byte key refused: %v", err)
	}
}

// A token of another format version is refused even when its MAC is right
// (made with the same key, as a replica of another release would): its
// bytes mean something else, so reading them as this version's would
// misread the lease.
func TestATokenOfAnotherVersionIsRefused(t *testing.T) {
	key := bytes.Repeat([]byte{1}, 32)
	s, err := NewSigner(key)
	if err != nil {
		t.Fatal(err)
	}
	raw, err := base64.RawURLEncoding.DecodeString(s.Sign(Token{EventID: uuid.New(), Epoch: 3, Aggregate: 4}))
	if err != nil {
		t.Fatal(err)
	}
	for _, v := range []byte{version - 1, version + 1} {
		raw[0] = v
		m := hmac.New(sha256.New, key)
		m.Write(raw[:signed])
		copy(raw[signed:], m.Sum(nil)[:macSize])
		if got, err := s.Verify(base64.RawURLEncoding.EncodeToString(raw)); !errors.Is(err, ErrInvalid) {
			t.Errorf("a version %d token verified as %+v, %v", v, got, err)
		}
	}
}

// AggregateHash tells aggregates apart by stream and key together: the key
// counts, and the boundary between stream and key is part of the hash, so
// stream "ab" with key "c" is not stream "a" with key "bc". A token names
// the aggregate it leased, not a neighbour.
func TestAggregateHashTellsStreamAndKeyApart(t *testing.T) {
	for _, pair := range [][2][2]string{
		{{"ab", "c"}, {"a", "bc"}},
		{{"orders", "1"}, {"orders", "2"}},
		{{"orders", "1"}, {"payments", "1"}},
	} {
		x, y := pair[0], pair[1]
		if AggregateHash(x[0], x[1]) == AggregateHash(y[0], y[1]) {
			t.Errorf("AggregateHash(%q, %q) == AggregateHash(%q, %q)", x[0], x[1], y[0], y[1])
		}
	}
}

// Every epoch an int64 holds and every aggregate hash round-trips: a token
// for epoch 2^32+1 is not read back as epoch 1.
func TestTokensRoundTripEveryEpochAndAggregate(t *testing.T) {
	s := signer(t, 1)
	for _, tok := range []Token{
		{EventID: uuid.New(), Epoch: 0, Aggregate: 0},
		{EventID: uuid.New(), Epoch: 1<<32 + 1, Aggregate: 1<<16 + 1},
		{EventID: uuid.New(), Epoch: math.MaxInt64, Aggregate: math.MaxUint32},
	} {
		if got, err := s.Verify(s.Sign(tok)); err != nil || got != tok {
			t.Errorf("Verify(Sign(%+v)) = %+v, %v", tok, got, err)
		}
	}
}

// A Signer keeps its own copy of the key: a caller that reuses or clears
// the slice it passed (a buffer read from the database) changes nothing of
// what the Signer signs and verifies, before its first token or after.
func TestASignerKeepsItsOwnCopyOfTheKey(t *testing.T) {
	key := bytes.Repeat([]byte{3}, 32)
	s, err := NewSigner(key)
	if err != nil {
		t.Fatal(err)
	}
	clear(key)
	other := signer(t, 3) // the same key, never cleared
	tok := Token{EventID: uuid.New(), Epoch: 9, Aggregate: AggregateHash("orders", "o1")}
	if got, want := s.Sign(tok), other.Sign(tok); got != want {
		t.Fatal("a token signed after the caller cleared its key slice is not the key's token")
	}
	if _, err := s.Verify(other.Sign(tok)); err != nil {
		t.Fatalf("the key's token, verified after the caller cleared its key slice: %v", err)
	}
}

// A token carries 128 bits of HMAC (the package's claim against forgery):
// 45 bytes in all, the last 16 of them the tag, each of which counts.
func TestATokenCarriesA128BitTag(t *testing.T) {
	s := signer(t, 5)
	str := s.Sign(Token{EventID: uuid.New(), Epoch: 1, Aggregate: 2})
	raw, err := base64.RawURLEncoding.DecodeString(str)
	if err != nil {
		t.Fatal(err)
	}
	if len(raw) != 1+16+8+4+16 {
		t.Fatalf("token is %d bytes, want 45 (version, event id, epoch, aggregate, 16-byte tag)", len(raw))
	}
	for i := len(raw) - 16; i < len(raw); i++ {
		b := bytes.Clone(raw)
		b[i] ^= 0x80
		if _, err := s.Verify(base64.RawURLEncoding.EncodeToString(b)); !errors.Is(err, ErrInvalid) {
			t.Fatalf("token with tag byte %d altered: %v, want ErrInvalid", i-(len(raw)-16), err)
		}
	}
}
