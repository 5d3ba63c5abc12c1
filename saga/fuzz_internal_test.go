package saga

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/segmentio/kafka-go"

	"github.com/sagaflow/sagaflow/internal/store"
	"github.com/sagaflow/sagaflow/steps"
)

// FuzzDecodeCommand: any bytes under any type decode to a valid command or
// to an error, never a panic; a command that decodes is one the executor
// can act on.
func FuzzDecodeCommand(f *testing.F) {
	id := uuid.NewString()
	f.Add(commandType, []byte(`{"saga_id":"`+id+`","saga":"checkout","step":"charge","direction":"forward","epoch":0,"version":1}`))
	f.Add(cancelType, []byte(`{"saga_id":"`+id+`","saga":"checkout","step":"charge","direction":"compensate","epoch":2,"version":9,"reason":"x"}`))
	f.Add(commandType, []byte(`{not json`))
	f.Add("orders.created", []byte(`{}`))
	f.Add(commandType, []byte(`{"saga_id":"00000000-0000-0000-0000-000000000000"}`))
	f.Fuzz(func(t *testing.T, typ string, payload []byte) {
		cmd, err := decodeCommand(&store.Claimed{Type: typ, Payload: payload})
		if err != nil {
			return
		}
		if cmd.SagaID == uuid.Nil || cmd.Saga == "" || cmd.Step == "" || !cmd.Direction.Valid() || cmd.Version <= 0 {
			t.Fatalf("decoded an unusable command: %+v", cmd)
		}
	})
}

// FuzzClaimedFromKafka: any Kafka message converts without a panic, and the
// executor's decoding of it does not panic either.
func FuzzClaimedFromKafka(f *testing.F) {
	f.Add([]byte(`{}`), store.HeaderMessageID, []byte(uuid.NewString()), store.HeaderSagaID, []byte("not-a-uuid"))
	f.Add([]byte{0xff, 0x00}, store.HeaderType, []byte(commandType), store.HeaderStepKey, []byte("a/b/c/d"))
	f.Fuzz(func(t *testing.T, value []byte, k1 string, v1 []byte, k2 string, v2 []byte) {
		m := kafka.Message{Value: value, Time: time.Now(), Headers: []kafka.Header{{Key: k1, Value: v1}, {Key: k2, Value: v2}}}
		c, ambiguous := claimedFromKafka(m)
		if k1 == k2 && strings.HasPrefix(k1, "sagaflow-") && ambiguous == nil {
			t.Fatalf("header %q repeated but not reported ambiguous", k1)
		}
		_, _ = decodeCommand(&c)
		// A dead letter of any message can be described.
		_ = kafkaDeadLetter(&m, c.IDText(), "fuzz")
		_, _ = steps.ParseKey(string(v1))
	})
}

// FuzzPersistedState feeds arbitrary bytes as a saga's stored state (a row
// edited by hand, a state type changed under running sagas) and as a
// participant's reply, through a compiled definition's local step, remote
// send and reply: each either works and yields valid JSON, or fails with an
// error (a stateDecodeError for state that does not decode) — never a panic.
func FuzzPersistedState(f *testing.F) {
	type inner struct {
		On bool `json:"on"`
	}
	type state struct {
		N     int                `json:"n"`
		Items []string           `json:"items"`
		Money map[string]float64 `json:"money"`
		Sub   *inner             `json:"sub"`
	}
	def := Define("fuzz",
		Step[state]{Name: "local", Action: func(_ context.Context, _ *StepRun, s *state) error {
			s.N++
			s.Items = append(s.Items, "x")
			return nil
		}, Compensate: func(_ context.Context, _ *StepRun, s *state) error {
			if s.Sub != nil {
				s.Sub.On = false
			}
			return nil
		}},
		Step[state]{Name: "remote", Remote: &Remote[state]{Topic: "t", Type: "t.do", CompensateType: "t.undo",
			Command: func(_ context.Context, _ *StepRun, s *state) (any, error) { return s, nil },
			OnReply: func(_ context.Context, _ *StepRun, s *state, result json.RawMessage) error {
				var r struct {
					Add int `json:"add"`
				}
				if err := json.Unmarshal(result, &r); err != nil {
					return err
				}
				s.N += r.Add
				return nil
			}}},
	)
	c, err := def.compile()
	if err != nil {
		f.Fatal(err)
	}
	f.Add([]byte(`{"n":1,"items":["a"],"money":{"eur":1.5},"sub":{"on":true}}`), []byte(`{"ok":true,"result":{"add":2}}`))
	f.Add([]byte(`null`), []byte(`{"ok":false,"code":"x","error":"no"}`))
	f.Add([]byte(`{"n":"one"}`), []byte(`{"ok":true,"result":"nope"}`))
	f.Add([]byte{0xff, '{'}, []byte(`[`))
	f.Fuzz(func(t *testing.T, raw, reply []byte) {
		ctx := context.Background()
		valid := func(what string, out []byte, err error) {
			if err == nil && !json.Valid(out) {
				t.Fatalf("%s: no error but invalid JSON %q", what, out)
			}
			var de *stateDecodeError
			if err != nil && !json.Valid(raw) && !errors.As(err, &de) {
				t.Fatalf("%s: state %q is not JSON but the error is not a stateDecodeError: %v", what, raw, err)
			}
		}
		for _, dir := range []steps.Direction{steps.Forward, steps.Compensate} {
			r := &StepRun{Step: "local", Direction: dir}
			out, err := c.run(ctx, r, 0, dir, raw)
			valid("run "+string(dir), out, err)
			out, err = c.send(ctx, r, 1, dir, raw)
			valid("send "+string(dir), out, err)
		}
		var rep steps.Reply
		if json.Unmarshal(reply, &rep) == nil {
			out, err := c.reply(ctx, &StepRun{Step: "remote", Direction: steps.Forward}, 1, raw, rep.Result)
			valid("reply", out, err)
		}
	})
}
