package sagatest_test

import (
	"context"
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/sagatest"
	"github.com/sagaflow/sagaflow/steps"
)

type checkout struct {
	OrderID  string `json:"order_id"`
	ChargeID string `json:"charge_id,omitempty"`
}

// remoteCheckout reserves stock with the inventory service (released when
// compensating) and charges with the payment service, over Kafka.
func remoteCheckout() *saga.Definition[checkout] {
	cmd := func(_ context.Context, _ *saga.StepRun, c *checkout) (any, error) { return c, nil }
	return saga.Define("checkout",
		saga.Step[checkout]{Name: "reserve", Remote: &saga.Remote[checkout]{
			Topic: "inventory.commands", Type: "inventory.reserve", CompensateType: "inventory.release", Command: cmd,
		}},
		saga.Step[checkout]{Name: "charge", Remote: &saga.Remote[checkout]{
			Topic: "payments.commands", Type: "payments.charge", Command: cmd,
			OnReply: func(_ context.Context, _ *saga.StepRun, c *checkout, result json.RawMessage) error {
				var r struct {
					ID string `json:"id"`
				}
				if err := json.Unmarshal(result, &r); err != nil {
					return err
				}
				c.ChargeID = r.ID
				return nil
			},
		}},
	)
}

// Two fake services, each with a schema of its own, drive a saga with
// remote steps to completion, and, once payments refuses, to compensation.
func TestFakeParticipantsDriveARemoteSaga(t *testing.T) {
	t.Parallel()
	b := setup(t, saga.CommandTopicDefault+".checkout", saga.CommandTopicDefault+".checkout.replies",
		"inventory.commands", "payments.commands")
	service := func(topic string, answers map[string]sagatest.Answer) *sagatest.Participant {
		pool, schema := migrated(t)
		return sagatest.NewParticipant(t, sagatest.ParticipantConfig{Brokers: b.kc.Addrs(), Topic: topic,
			Pool: pool, Schema: schema, Answers: answers}) // the default Consumer for both
	}
	inventory := service("inventory.commands", map[string]sagatest.Answer{
		"inventory.reserve": sagatest.Reply(nil),
		"inventory.release": sagatest.Reply(nil),
	})
	payments := service("payments.commands", map[string]sagatest.Answer{
		"payments.charge": sagatest.Reply(map[string]string{"id": "ch_1"}),
	})
	def := remoteCheckout()
	b.start(t, def)
	ctx := context.Background()

	st, err := saga.Start(ctx, b.engine, def, checkout{OrderID: "o-1"}, nil)
	require.NoError(t, err)
	in := sagatest.WaitEnded(t, b.engine, st.ID, nil)
	require.Equal(t, saga.StatusCompleted, in.Status)
	sagatest.RequireTimeline(t, in, "saga_started", "command_sent:reserve", "reply_received:reserve", "step_completed:reserve",
		"command_sent:charge", "reply_received:charge", "step_completed:charge", "saga_completed")
	var state checkout
	require.NoError(t, in.DecodeState(&state))
	require.Equal(t, "ch_1", state.ChargeID, "the configured result reached OnReply")
	charges := payments.Calls()
	require.Len(t, charges, 1)
	require.Equal(t, steps.Key{SagaID: st.ID, Step: "charge", Direction: steps.Forward}, charges[0].Key)
	require.JSONEq(t, `{"order_id": "o-1"}`, string(charges[0].Command))

	payments.Answer("payments.charge", sagatest.Refuse("card_declined", "the card was declined"))
	st, err = saga.Start(ctx, b.engine, def, checkout{OrderID: "o-2"}, nil)
	require.NoError(t, err)
	in = sagatest.WaitEnded(t, b.engine, st.ID, nil)
	require.Equal(t, saga.StatusCompensated, in.Status)
	require.Equal(t, saga.ErrorInfo{Code: "card_declined", Message: in.LastError.Message, Step: "charge"}, *in.LastError)
	require.Contains(t, in.LastError.Message, "the card was declined")
	sagatest.RequireTimeline(t, in, "saga_started", "command_sent:reserve", "reply_received:reserve", "step_completed:reserve",
		"command_sent:charge", "step_failed:charge",
		"compensation_started:reserve", "command_sent:reserve", "reply_received:reserve", "compensation_completed:reserve",
		"saga_compensated")
	var types []string
	for _, c := range inventory.Calls() {
		if c.Key.SagaID == st.ID {
			types = append(types, c.Type+"/"+string(c.Direction))
		}
	}
	require.Equal(t, []string{"inventory.reserve/forward", "inventory.release/compensate"}, types)
}

// A refused compensation fails the saga; AnswerFunc sees the call.
func TestFakeParticipantRefusingACompensationFailsTheSaga(t *testing.T) {
	t.Parallel()
	b := setup(t, saga.CommandTopicDefault+".checkout", saga.CommandTopicDefault+".checkout.replies",
		"inventory.commands", "payments.commands")
	// Both services share the engine's schema here: simpler, as good.
	released := make(chan steps.Key, 10)
	sagatest.NewParticipant(t, sagatest.ParticipantConfig{Brokers: b.kc.Addrs(), Topic: "inventory.commands",
		Pool: b.pool, Schema: b.schema, Consumer: "inventory", Answers: map[string]sagatest.Answer{
			"inventory.reserve": sagatest.Reply(nil),
			"inventory.release": sagatest.AnswerFunc(func(_ context.Context, c sagatest.Call) (any, error) {
				released <- c.Key
				return nil, steps.Permanent(steps.WithCode("warehouse_closed", context.DeadlineExceeded))
			}),
		}})
	sagatest.NewParticipant(t, sagatest.ParticipantConfig{Brokers: b.kc.Addrs(), Topic: "payments.commands",
		Pool: b.pool, Schema: b.schema, Consumer: "payments", Answers: map[string]sagatest.Answer{
			"payments.charge": sagatest.Refuse("card_declined", "declined"),
		}})
	def := remoteCheckout()
	b.start(t, def)
	st, err := saga.Start(context.Background(), b.engine, def, checkout{OrderID: "o-3"}, nil)
	require.NoError(t, err)
	in := sagatest.Wait(t, b.engine, st.ID, sagatest.Status(saga.StatusFailed), nil)
	require.Equal(t, "warehouse_closed", in.LastError.Code)
	require.Equal(t, steps.Key{SagaID: st.ID, Step: "reserve", Direction: steps.Compensate}, <-released)
}

func TestFakeParticipantRefusesAnAnswerForATypeItDoesNotServe(t *testing.T) {
	t.Parallel()
	b := setup(t, "inventory.commands")
	f := &fakeTB{TB: t}
	p := sagatest.NewParticipant(f, sagatest.ParticipantConfig{Brokers: b.kc.Addrs(), Topic: "inventory.commands",
		Pool: b.pool, Schema: b.schema, Answers: map[string]sagatest.Answer{"inventory.reserve": sagatest.Reply(nil)}})
	require.Empty(t, f.run(func() { p.Answer("inventory.reserve", sagatest.NoReply()) }))
	require.Equal(t, `sagatest: participant: "inventory.release" is not one of the command types in ParticipantConfig.Answers`,
		f.run(func() { p.Answer("inventory.release", sagatest.Reply(nil)) }))
	require.Contains(t, failure(t, func(tb testing.TB) {
		sagatest.NewParticipant(tb, sagatest.ParticipantConfig{Brokers: b.kc.Addrs(), Topic: "inventory.commands",
			Pool: b.pool, Schema: b.schema})
	}), "ParticipantConfig.Answers is required")
}
