package server

import "sync/atomic"

// hook holds a function that tests set on a Server to watch or steer it.
// Tests set hooks while sessions claim, acks commit and loops run, so a
// hook is read and written atomically: a plain field would race the
// goroutines that call it (the race detector caught two such fields).
// The zero hook is unset.
type hook[F any] struct{ f atomic.Pointer[F] }

// set makes f the hook's function.
func (h *hook[F]) set(f F) { h.f.Store(&f) }

// get returns the hook's function, or the zero F (a nil func) when unset.
func (h *hook[F]) get() (f F) {
	if p := h.f.Load(); p != nil {
		f = *p
	}
	return f
}
