package main

import (
	"context"
	"fmt"
	"regexp"
	"strings"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/saga"
)

// dsnForm is a way to write a connection string with a password.
type dsnForm struct {
	name string
	// password is the password as the server would receive it.
	password string
	// written is how the connection string spells it, when not as is.
	written string
	// make writes the connection string for a host, port, user, database.
	make func(host string, port uint16, user, db string) string
}

// dsnForms are the spellings pgx's redaction missed (issue #11), and
// URL-encoded, quoted and escaped passwords.
var dsnForms = []dsnForm{
	{name: "keyword value with blanks around =", password: "S3cretPW",
		make: func(h string, p uint16, u, db string) string {
			return fmt.Sprintf("host=%s port=%d user=%s password = S3cretPW dbname=%s", h, p, u, db)
		}},
	{name: "keyword value quoted after =blank", password: "S3cretPW",
		make: func(h string, p uint16, u, db string) string {
			return fmt.Sprintf("host=%s port=%d user=%s password= 'S3cretPW' dbname=%s", h, p, u, db)
		}},
	{name: "URL with an unencoded @", password: "S3c@retPW",
		make: func(h string, p uint16, u, db string) string {
			return fmt.Sprintf("postgres://%s:S3c@retPW@%s:%d/%s", u, h, p, db)
		}},
	{name: "URL with an encoded password", password: "Kq7@Zx/9Wv", written: "Kq7%40Zx%2F9Wv",
		make: func(h string, p uint16, u, db string) string {
			return fmt.Sprintf("postgres://%s:Kq7%%40Zx%%2F9Wv@%s:%d/%s", u, h, p, db)
		}},
	{name: "URL with the password in the query", password: "Pw6QueryZ",
		make: func(h string, p uint16, u, db string) string {
			return fmt.Sprintf("postgres://%s@%s:%d/%s?password=Pw6QueryZ", u, h, p, db)
		}},
	{name: "keyword value quoted with escapes", password: `Mn4' Jy\Rb8`, written: `Mn4\' Jy\\Rb8`,
		make: func(h string, p uint16, u, db string) string {
			return fmt.Sprintf(`host=%s port=%d user=%s password='Mn4\' Jy\\Rb8' dbname=%s`, h, p, u, db)
		}},
}

// forbidden are the strings no output may hold for form: the password as
// sent and as written, and its pieces of 3 or more letters and digits.
func (form dsnForm) forbidden() []string {
	out := []string{form.password}
	if form.written != "" {
		out = append(out, form.written)
	}
	for _, s := range []string{form.password, form.written} {
		out = append(out, regexp.MustCompile(`[A-Za-z0-9]{3,}`).FindAllString(s, -1)...)
	}
	return out
}

// TestNoOutputHoldsThePassword runs every command, with its help, usage,
// JSON and error paths, with a password in each spelling of dsnForms,
// against the test server and against targets that fail in each way, and
// requires that neither stdout nor stderr ever holds the password or a
// piece of it.
func TestNoOutputHoldsThePassword(t *testing.T) {
	t.Parallel()
	f := setup(t)
	cfg, err := pgx.ParseConfig(f.url)
	require.NoError(t, err)
	e, orderDef, _ := f.engine(t, false)
	st, err := saga.Start(context.Background(), e, orderDef, order{ID: "o-secret"}, nil)
	require.NoError(t, err)
	id, missing := st.ID.String(), uuid.NewString()

	type target struct {
		name           string
		host, user, db string
		port           uint16
		listCode       int    // exit code of "list"
		listSays       string // in the error of "list"
	}
	targets := []target{
		{name: "test server", host: cfg.Host, port: cfg.Port, user: cfg.User, db: cfg.Database, listCode: exitOK},
		{name: "refused", host: "127.0.0.1", port: 1, user: "postgres", db: "x", listCode: exitUnreachable,
			listSays: "connection refused"},
		// A label longer than 63 bytes: the resolver refuses it at once,
		// without a network round trip per call.
		{name: "unknown host", host: "sagaflow-no-such-host-" + strings.Repeat("x", 50) + ".invalid", port: 5432, user: "postgres", db: "x",
			listCode: exitUnreachable, listSays: "is unreachable"},
		{name: "unknown role", host: cfg.Host, port: cfg.Port, user: "sagaflow_no_such_role", db: cfg.Database,
			listCode: exitUnreachable, listSays: `role "sagaflow_no_such_role" does not exist`},
		{name: "unknown database", host: cfg.Host, port: cfg.Port, user: cfg.User, db: "sagaflow_no_such_db",
			listCode: exitUnreachable, listSays: "refused the connection"},
	}

	for _, form := range dsnForms {
		t.Run(form.name, func(t *testing.T) {
			t.Parallel()
			// One more target per form: a connection string that does not
			// parse (a port that is not a number).
			unparsable := strings.Replace(form.make("127.0.0.1", 65000, "postgres", "x"), "65000", "notaport", 1)
			if !strings.Contains(unparsable, "notaport") {
				t.Fatalf("no port in %s", unparsable)
			}
			dsns := map[string]string{"unparsable": unparsable}
			for _, tg := range targets {
				dsns[tg.name] = form.make(tg.host, tg.port, tg.user, tg.db)
			}

			for name, dsn := range dsns {
				flagArgs := func(args ...string) []string {
					return append([]string{"--database-url", dsn, "--schema", f.Schema, "--timeout", "10s"}, args...)
				}
				type call struct {
					env  map[string]string
					args []string
				}
				calls := []call{
					{args: flagArgs("list")}, // first: its exit code is checked below
					{args: flagArgs("list", "--json")},
					{args: flagArgs("show", id)},
					{args: flagArgs("show", id, "--json")},
					{args: flagArgs("show", missing)},
					{args: flagArgs("--json", "show", missing)},
					{args: flagArgs("show", "nope")},
					{args: flagArgs("outbox", "status")},
					{args: flagArgs("outbox", "replay", "--dry-run")},
					{args: flagArgs("replay", "--bulk", "--dry-run")},
					{args: flagArgs("replay", missing)},
					{args: flagArgs("cancel", missing)},
					{args: flagArgs("migrate")},
					{args: flagArgs("list", "-h")},
					{args: flagArgs("help", "replay")},
					{args: flagArgs("list", "--bogus")},
					{args: flagArgs("purge")},
					{args: []string{"--database-url=" + dsn, "--schema", f.Schema, "list"}},
					{env: map[string]string{"DATABASE_URL": dsn}, args: []string{"--schema", f.Schema, "list"}},
					{env: map[string]string{"DATABASE_URL": dsn}, args: []string{"--schema", f.Schema, "--json", "outbox", "status"}},
					// A connection string given in the wrong place.
					{args: []string{"show", dsn}},
					{args: []string{"--timeout", dsn, "list"}},
					{args: []string{dsn}},
					{args: []string{"--schema", "--database-url", dsn, "list"}},
				}
				for i, cl := range calls {
					r := runCLI(t, cl.env, cl.args...)
					for _, secret := range form.forbidden() {
						require.NotContains(t, r.stdout, secret, "%s: stdout of %q", name, cl.args)
						require.NotContains(t, r.stderr, secret, "%s: stderr of %q", name, cl.args)
					}
					if i > 0 {
						continue
					}
					// The paths above were really taken, and the error says why.
					tg := target{listCode: exitUsage, listSays: "--database-url is not a valid connection string (it is not shown"}
					for _, candidate := range targets {
						if candidate.name == name {
							tg = candidate
						}
					}
					code, says := tg.listCode, tg.listSays
					if form.name == "URL with an unencoded @" && name != "unparsable" {
						// pgx reads the password up to the first '@', and the
						// rest as the host: unreachable, whatever the target,
						// and the message, which names that host, is withheld.
						code, says = exitUnreachable, withheld
					}
					require.Equal(t, code, r.code, "%s: list: %s%s", name, r.stdout, r.stderr)
					require.Contains(t, r.stdout+r.stderr, says, name)
				}
			}
		})
	}
}

func TestSecretsRedact(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		dsn, msg string
		held     bool // the message holds the password, or a piece of it
	}{
		{"postgres://u:pw1234@h/db", "lookup pw1234 failed", true},
		{"postgres://u:S3c@retPW@h/db", "lookup retPW@h: no such host", true},
		{"postgres://u:S3c@retPW@h/db", `"S3c@retPW"`, true},
		// An unencoded '/' ends the host: pgx reads the rest as the database.
		{"postgres://u:pass/word1@h/db", `database "word1@h/db" does not exist`, true},
		{"postgres://u:a%40b%2Fcdef@h/db", "a@b/cdef", true},
		{"postgres://u:a%40b%2Fcdef@h/db", "a%40b%2Fcdef", true},
		{"host=h password = S3cretPW user=u", "password = S3cretPW user=u", true},
		{"host=h password= 'S3c ret' user=u", "'S3c ret'", true},
		{`password='it\'s\\ok'`, `"it's\\ok"`, true},
		{"postgres://h/db?sslmode=disable&password=Qq9xx&x=1", "sslmode=disable Qq9xx", true},
		{"postgres://h/db?pass%77ord=Qq9xx", "Qq9xx", true},
		{"--database-url=postgres://u:pw9@h", "pw9", true},
		{"postgres://u:127@h/db", "dial 127.0.0.1:5432: connection refused", true},
		{"postgres://u@h/db", "u@h/db", false},
		{"postgres://u:pw1234@h/db", "connection refused", false},
		{"list", "list", false},
		{"pw", "pw", false}, // nothing in an argument that holds no password
	} {
		var s secrets
		s.addDSN(tc.dsn)
		want := tc.msg
		if tc.held {
			want = withheld
		}
		require.Equal(t, want, s.redact(tc.msg), "%s in %s", tc.msg, tc.dsn)
		// Nothing of a withheld message shows through.
		if tc.held {
			require.NotContains(t, s.redact(tc.msg), "xxxxx")
		}
	}

	// A piece shorter than minPiece is not looked for on its own.
	var s secrets
	s.add("ab@cdef")
	require.Equal(t, "ab c", s.redact("ab c"))
	require.Equal(t, withheld, s.redact("cdef"))
}
