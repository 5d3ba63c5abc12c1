-- Dead letters keep the raw bytes of their headers (the headers column holds
-- a storable rendering of them), and can be sent again by an operator.
-- raw_headers is a JSON array of {"k": base64 name, "v": base64 value}, in
-- the order the message carried them.
ALTER TABLE {{schema}}.dead_letters ADD COLUMN raw_headers jsonb;
ALTER TABLE {{schema}}.dead_letters ADD COLUMN requeued_at timestamptz;

-- One dead letter per consumer and Kafka position: a redelivery of a message
-- that is being dead-lettered adds no second row.
DELETE FROM {{schema}}.dead_letters d
    USING {{schema}}.dead_letters e
    WHERE d.consumer = e.consumer AND d.topic = e.topic
      AND d.kafka_partition = e.kafka_partition AND d.kafka_offset = e.kafka_offset
      AND d.id > e.id;
CREATE UNIQUE INDEX dead_letters_position ON {{schema}}.dead_letters (consumer, topic, kafka_partition, kafka_offset)
    WHERE kafka_offset IS NOT NULL;
CREATE INDEX dead_letters_pending ON {{schema}}.dead_letters (created_at) WHERE requeued_at IS NULL;

-- Cancel requests, durable until an engine applies them (or refuses them
-- because the saga has ended). A request is a row of its own rather than a
-- column of the saga, so that recording one never waits on the saga's row
-- lock while a step runs. Applying it deletes it, in the transaction that
-- moves the saga to compensating.
CREATE TABLE {{schema}}.saga_cancel_requests (
    saga_id      uuid        PRIMARY KEY,
    epoch        integer     NOT NULL,
    reason       text        NOT NULL,
    requested_at timestamptz NOT NULL DEFAULT now()
);
