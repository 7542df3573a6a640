package connstring_test

import (
	"strings"
	"testing"

	"github.com/outboxd/outboxd/internal/connstring"
)

func TestRedactHidesEveryPassword(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ in, want string }{
		// URLs: the user information's password, the query's.
		{"postgres://u:s3cret@h:5432/db?sslmode=disable", "postgres://u:xxxxx@h:5432/db?sslmode=disable"},
		{"postgresql://u:s3@cret@h/db", "postgresql://u:xxxxx@h/db"},
		{"postgres://u@h/db?password=s3cret&sslmode=disable", "postgres://u@h/db?password=xxxxx&sslmode=disable"},
		{"postgres://h/db?sslmode=verify-full&sslpassword=s3cret", "postgres://h/db?sslmode=verify-full&sslpassword=xxxxx"},
		{"postgres://h/db?password=s3cret#x", "postgres://h/db?password=xxxxx#x"},
		{"postgres://u:s3cret@h", "postgres://u:xxxxx@h"},
		{"postgres://u:s3cret@h/db?x=a@b", "postgres://u:xxxxx@h/db?x=a@b"},
		// Nothing to hide: kept as written.
		{"postgres://u@h/db?passfile=/p&application_name=password", "postgres://u@h/db?passfile=/p&application_name=password"},
		{"postgres://h/db?x=1&mypassword=2", "postgres://h/db?x=1&mypassword=2"},
		{"postgres:///db?host=/run/postgresql", "postgres:///db?host=/run/postgresql"},
		// key=value strings, bare and quoted, with white space around '='.
		{"host=h user=u password=s3cret dbname=db", "host=h user=u password=xxxxx dbname=db"},
		{"password=s3cret host=h", "password=xxxxx host=h"},
		{"host=h password = 's3 cr\\'et' dbname=db", "host=h password = xxxxx dbname=db"},
		{"host=h\tsslpassword=s3cret", "host=h\tsslpassword=xxxxx"},
		{"host=h password='unterminated s3cret", "host=h password=xxxxx"}, // the rest may all be the value
		{"host=h passfile=/p user=password", "host=h passfile=/p user=password"},
		{"", ""},
		// Keys in any case.
		{"host=h PASSWORD=s3cret", "host=h PASSWORD=xxxxx"},
		{"postgres://h/db?Password=s3cret", "postgres://h/db?Password=xxxxx"},
	} {
		got := connstring.Redact(tc.in)
		if got != tc.want {
			t.Errorf("Redact(%q) = %q, want %q", tc.in, got, tc.want)
		}
		if has := connstring.HasPassword(tc.in); has != (tc.want != tc.in) {
			t.Errorf("HasPassword(%q) = %v", tc.in, has)
		}
	}
	// A password that reads as Hidden is a password all the same.
	for _, conn := range []string{"postgres://u:xxxxx@h/db", "postgres://h/db?password=xxxxx", "host=h password=xxxxx"} {
		if !connstring.HasPassword(conn) {
			t.Errorf("HasPassword(%q) = false", conn)
		}
	}
}

// Whatever the input, the secret does not come back: a fuzzed password in
// every place a connection string can carry one.
func FuzzRedactNeverShowsThePassword(f *testing.F) {
	f.Add("s3cret")
	f.Add("a@b/c")
	f.Add("x y'z")
	f.Fuzz(func(t *testing.T, pw string) {
		if len(pw) < 6 || strings.ContainsAny(pw, "&#?/@:% \t\n\r\v\f'\\=") {
			return // a password that a connection string could not carry unescaped here
		}
		for _, conn := range []string{
			"postgres://u:" + pw + "@h/db",
			"postgres://u@h/db?password=" + pw,
			"host=h password=" + pw + " dbname=db",
			"host=h password='" + pw + "' dbname=db",
		} {
			if got := connstring.Redact(conn); strings.Contains(got, pw) {
				t.Fatalf("Redact(%q) = %q shows the password", conn, got)
			}
		}
	})
}
