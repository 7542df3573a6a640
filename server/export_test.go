package server

import "context"

// RunJanitor runs one retention pass now and reports what it did.
func (s *Server) RunJanitor(ctx context.Context) (deleted, batches int64, err error) {
	res, err := s.runJanitor(ctx)
	return res.deleted, res.batches, err
}

// Stopping is closed once Stop has begun.
func (s *Server) Stopping() <-chan struct{} { return s.stopping }

// SetBeforeAddSession makes every Subscribe call f once its checks passed,
// just before its session is added. Set it before the first Subscribe.
func (s *Server) SetBeforeAddSession(f func()) { s.beforeAddSession = f }
