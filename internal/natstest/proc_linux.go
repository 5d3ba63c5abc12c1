//go:build linux

package natstest

import "syscall"

// sysProcAttr makes the server get SIGKILL when the test process dies, so
// that no server outlives it.
func sysProcAttr() *syscall.SysProcAttr { return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL} }
