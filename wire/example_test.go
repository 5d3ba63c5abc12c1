package wire_test

import (
	"fmt"

	"github.com/sagaflow/sagaflow/wire"
)

func ExampleKey() {
	id, _ := wire.ParseUUID("0193a0f4-6a8e-7c4b-9d6e-2f1a3b4c5d6e")
	k := wire.Key{SagaID: id, Step: "charge", Direction: wire.Forward, Epoch: 0}
	fmt.Println(k)
	back, err := wire.ParseKey(k.String())
	fmt.Println(back == k, err)
	// Output:
	// 0193a0f4-6a8e-7c4b-9d6e-2f1a3b4c5d6e/charge/forward/0
	// true <nil>
}

func ExamplePartition() {
	// The partition the Java client's default partitioner picks for a
	// saga's messages on a topic of 100 partitions.
	fmt.Println(wire.Partition([]byte("0193a0f4-6a8e-7c4b-9d6e-2f1a3b4c5d6e"), 100))
	fmt.Println(wire.Murmur2([]byte("21")))
	// Output:
	// 28
	// -973932308
}

func ExampleDecodeCommand() {
	payload := []byte(`{"saga_id":"0193a0f4-6a8e-7c4b-9d6e-2f1a3b4c5d6e","saga":"checkout","step":"charge",
		"direction":"forward","epoch":0,"version":3,"added_by_a_newer_engine":true}`)
	c, err := wire.DecodeCommand(wire.TypeStep, payload)
	fmt.Println(c.Key(), c.Version, err)

	_, err = wire.DecodeCommand(wire.TypeStep, []byte(`{"saga_id":"0193a0f4-6a8e-7c4b-9d6e-2f1a3b4c5d6e","saga":"checkout","step":"ch\u0000arge"}`))
	fmt.Println(err)
	// Output:
	// 0193a0f4-6a8e-7c4b-9d6e-2f1a3b4c5d6e/charge/forward/0 3 <nil>
	// decode payload: field "step" contains a NUL byte: not storable text
}

func ExampleDecodeReply() {
	r, err := wire.DecodeReply([]byte(`{"ok":false,"error":"card declined","code":"card_declined"}`))
	fmt.Println(r.OK, r.Code, r.Error, err)
	// Output:
	// false card_declined card declined <nil>
}
