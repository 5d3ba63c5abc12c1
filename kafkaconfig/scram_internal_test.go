package kafkaconfig

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"
)

// session starts an exchange with a fixed client nonce, as test vectors
// need.
func session(t *testing.T, m *scramMechanism, nonce string) *scramSession {
	t.Helper()
	sm, first, err := m.Start(context.Background())
	require.NoError(t, err)
	s := sm.(*scramSession)
	require.Regexp(t, `^n,,n=[^,]+,r=[A-Za-z0-9+/]{32}$`, string(first))
	s.nonce = nonce
	s.clientFirstBare = "n=" + scramEscaper.Replace(m.username) + ",r=" + nonce
	return s
}

// The SCRAM-SHA-256 exchange of RFC 7677, section 3.
func TestSCRAMSHA256RFC7677(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s := session(t, newSCRAM(MechanismSCRAMSHA256, "user", "pencil"), "rOprNGfwEbeRWgbNEkqO")
	done, final, err := s.Next(ctx, []byte("r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,s=W22ZaJ0SNY7soEsUEjb6gQ==,i=4096"))
	require.NoError(t, err)
	require.False(t, done)
	require.Equal(t, "c=biws,r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,p=dHzbZapWIk4jUhN+Ute9ytag9zjfMHgsqmmiz7AndVQ=", string(final))
	done, last, err := s.Next(ctx, []byte("v=6rriTRBi23WpRR/wtup+mMhUZUn/dB5nLTJRsjl95G4="))
	require.NoError(t, err)
	require.True(t, done)
	require.Nil(t, last)
}

func TestSCRAMRefusesABadServer(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	const serverFirst = "r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,s=W22ZaJ0SNY7soEsUEjb6gQ==,i=4096"
	for _, tt := range []struct{ name, serverFirst, serverFinal, want string }{
		{"too few iterations", "r=rOprNGfwEbeRWgbNEkqO%hv,s=W22ZaJ0SNY7soEsUEjb6gQ==,i=1024", "", `"1024" iterations, fewer than 4096`},
		{"nonce not extended", "r=rOprNGfwEbeRWgbNEkqO,s=W22ZaJ0SNY7soEsUEjb6gQ==,i=4096", "", "does not extend the client's"},
		{"another nonce", "r=somethingElse%hv,s=W22ZaJ0SNY7soEsUEjb6gQ==,i=4096", "", "does not extend the client's"},
		{"salt not base64", "r=rOprNGfwEbeRWgbNEkqO%hv,s=!!,i=4096", "", "the salt is not base64"},
		{"mandatory extension", "m=ext,r=rOprNGfwEbeRWgbNEkqO%hv,s=W22ZaJ0SNY7soEsUEjb6gQ==,i=4096", "", "mandatory extension not supported"},
		{"malformed", "garbage", "", `malformed attribute "garbage"`},
		{"wrong server signature", serverFirst, "v=AAAAZapWIk4jUhN+Ute9ytag9zjfMHgsqmmiz7AndVQ=", "the server's signature does not verify"},
		{"server error", serverFirst, "e=invalid-proof", "the server refused: invalid-proof"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			s := session(t, newSCRAM(MechanismSCRAMSHA256, "user", "pencil"), "rOprNGfwEbeRWgbNEkqO")
			_, _, err := s.Next(ctx, []byte(tt.serverFirst))
			if tt.serverFinal != "" {
				require.NoError(t, err)
				_, _, err = s.Next(ctx, []byte(tt.serverFinal))
			}
			require.ErrorContains(t, err, "kafkaconfig: SCRAM-SHA-256: ")
			require.ErrorContains(t, err, tt.want)
			require.NotContains(t, err.Error(), "pencil")
		})
	}
}

func TestSCRAMEscapesTheUsername(t *testing.T) {
	t.Parallel()
	_, first, err := newSCRAM(MechanismSCRAMSHA512, "a,b=c", "pw").Start(context.Background())
	require.NoError(t, err)
	require.Regexp(t, `^n,,n=a=2Cb=3Dc,r=`, string(first))
}
