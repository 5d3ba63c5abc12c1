package fault

import "context"

// Hook is called at each point reached by a goroutine whose context carries
// it (see [WithHook]). sagatest's crash matrix uses it to crash one engine,
// in a normal build, without the sagaflow_faults tag: a hook may block, and
// may end its goroutine with runtime.Goexit, as a crash would.
type Hook func(point string)

type hookKey struct{}

// WithHook returns a context that carries h to every [At] reached under it.
// Only code inside sagaflow can make one: the key is this package's.
func WithHook(ctx context.Context, h Hook) context.Context {
	return context.WithValue(ctx, hookKey{}, h)
}

// At marks point for a goroutine working under ctx: it is [Hit], then the
// hook that ctx carries, if any.
func At(ctx context.Context, point string) {
	Hit(point)
	if h, ok := ctx.Value(hookKey{}).(Hook); ok {
		h(point)
	}
}
