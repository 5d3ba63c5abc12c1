package testkit

// RandomLetters returns n letters and digits from a fixed xorshift
// sequence: the same string on every run, with too little repetition to
// compress well (so that 10 kB of it stays over PostgreSQL's btree limit
// in an indexed column).
func RandomLetters(n int) string {
	const letters = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
	b := make([]byte, n)
	x := uint64(88172645463325252)
	for i := range b {
		x ^= x << 13
		x ^= x >> 7
		x ^= x << 17
		b[i] = letters[x%uint64(len(letters))]
	}
	return string(b)
}
