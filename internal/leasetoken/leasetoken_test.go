package leasetoken

import (
	"bytes"
	"errors"
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
