//go:build linux

package pgtest

import "syscall"

// sysProcAttr returns the attributes of initdb and postgres: run as cred
// (nil for the current user), and get SIGKILL when the test process dies so
// that no server outlives it.
func sysProcAttr(cred *syscall.Credential) *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Credential: cred, Pdeathsig: syscall.SIGKILL}
}
