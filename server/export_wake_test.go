package server

// DiscoverWakePending is how many wake-ups of the discovery loop (a
// producer's notice while it sleeps, the end of its sleep) wait for the
// loop to take them: 0 or 1.
func (s *Server) DiscoverWakePending() int { return len(s.discoverWake) }
