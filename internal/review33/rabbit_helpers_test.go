package review33_test

import (
	"os"

	"github.com/sagaflow/sagaflow/transport/rabbitbus"
)

func rabbitURL() string {
	if u := os.Getenv("RABBITMQ_URL"); u != "" {
		return u
	}
	return "amqp://guest:guest@127.0.0.1:5672/"
}

// dropQueues deletes the queues of groups for topic's partitions, on a
// connection of its own.
func dropQueues(groups []string, topic string, partitions int) {
	if partitions <= 0 || partitions > rabbitbus.PartitionsMax {
		partitions = rabbitbus.PartitionsDefault
	}
	conn, err := rabbitbus.Dial(rabbitURL())()
	if err != nil {
		return
	}
	defer conn.Close()
	for _, g := range groups {
		for p := range partitions {
			ch, err := conn.Channel()
			if err != nil {
				return
			}
			_, _ = ch.QueueDelete(rabbitbus.QueueName(g, topic, p), false, false, false)
			_ = ch.Close()
		}
	}
}

// dropExchange deletes an exchange, on a connection of its own.
func dropExchange(name string) {
	conn, err := rabbitbus.Dial(rabbitURL())()
	if err != nil {
		return
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return
	}
	_ = ch.ExchangeDelete(name, false, false)
	_ = ch.Close()
}
