package server

import "context"

// RunJanitor runs one retention pass now and reports what it did.
func (s *Server) RunJanitor(ctx context.Context) (deleted, batches int64, err error) {
	res, err := s.runJanitor(ctx)
	return res.deleted, res.batches, err
}

// Stopping is closed once Stop has begun.
func (s *Server) Stopping() <-chan struct{} { return s.stopping }
