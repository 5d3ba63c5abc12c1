// Package wire is sagaflow's wire protocol: what a message between a saga's
// engine and a participant looks like on the bus. It names the headers and
// message types, writes and parses the step-scoped key, encodes and decodes
// the command and reply payloads, and places a key on a partition as the
// Java client does.
//
// It depends on the standard library only, so that anything that speaks
// the protocol (a Go service without the participant runtime, a bridge, a
// test) can import it without pgx or kafka-go. docs/protocol.md is the same
// contract written down for services in other languages.
//
// # Decoding
//
// The decoders are tolerant of fields they do not know, so that a rolling
// upgrade that adds a field does not dead-letter the messages of the newer
// version. Every field they do know is checked, and an error names the
// field: a value of the wrong JSON type, a NUL byte, invalid UTF-8, or a
// value longer than the field allows. Decoding never panics.
package wire
