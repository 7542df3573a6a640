package multisource

import (
	"strings"
	"testing"
)

func TestValidName(t *testing.T) {
	t.Parallel()
	for _, ok := range []string{"default", "orders", "a", "o_2", strings.Repeat("a", 32)} {
		if err := ValidName(ok); err != nil {
			t.Errorf("ValidName(%q): %v", ok, err)
		}
	}
	for _, bad := range []string{"", "Orders", "2a", "_a", "a-b", "a.b", "a/b", "a*", strings.Repeat("a", 33)} {
		if ValidName(bad) == nil {
			t.Errorf("ValidName(%q) accepted it", bad)
		}
	}
}

// A token's source survives the round trip; default's token is left as it
// is, and a token without a prefix is default's.
func TestTokenRoundTrip(t *testing.T) {
	t.Parallel()
	const inner = "AgAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA-_"
	if got := wrapToken(Default, inner); got != inner {
		t.Errorf("default's token wrapped to %q", got)
	}
	for _, src := range []string{"orders", Default} {
		if s, tok := unwrapToken(wrapToken(src, inner)); s != src || tok != inner {
			t.Errorf("round trip of %s: %q, %q", src, s, tok)
		}
	}
	if s, _ := unwrapToken("default." + inner); s != Default {
		t.Errorf("default.-prefixed token is of %q", s)
	}
}

func TestSplitAndJoinStream(t *testing.T) {
	t.Parallel()
	for addr, want := range map[string][2]string{
		"sales_order":        {Default, "sales_order"},
		"orders/sales_order": {"orders", "sales_order"},
		"*/payments":         {"*", "payments"},
		"orders/*":           {"orders", "*"},
	} {
		if src, s := SplitStream(addr); src != want[0] || s != want[1] {
			t.Errorf("SplitStream(%q) = %q, %q; want %q", addr, src, s, want)
		}
	}
	if JoinStream(Default, "a") != "a" || JoinStream("orders", "a") != "orders/a" {
		t.Error("JoinStream")
	}
}
