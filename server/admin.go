package server

import (
	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
)

// adminService implements outbox.v1.AdminService. Its RPCs are not built yet
// and answer UNIMPLEMENTED (issue 4 builds them).
type adminService struct {
	outboxv1.UnimplementedAdminServiceServer
	s *Server
}
