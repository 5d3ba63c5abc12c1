//go:build unix && !linux

package pgtest

import "syscall"

// sysProcAttr returns the attributes of initdb and postgres: run as cred
// (nil for the current user). Without a parent-death signal on this system,
// a server outlives a test process that is killed; [Main] stops it on a
// normal exit.
func sysProcAttr(cred *syscall.Credential) *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Credential: cred}
}
