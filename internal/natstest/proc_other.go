//go:build !linux

package natstest

import "syscall"

func sysProcAttr() *syscall.SysProcAttr { return nil }
