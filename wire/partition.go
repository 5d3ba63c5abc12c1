package wire

// Murmur2 is the 32-bit murmur2 hash of data as the Apache Kafka Java
// client computes it (org.apache.kafka.common.utils.Utils.murmur2, seed
// 0x9747b28c), with the same result as the Java int.
func Murmur2(data []byte) int32 {
	const (
		seed uint32 = 0x9747b28c
		m    uint32 = 0x5bd1e995
		r           = 24
	)
	n := len(data)
	h := seed ^ uint32(n)
	for i := 0; i+4 <= n; i += 4 {
		k := uint32(data[i]) | uint32(data[i+1])<<8 | uint32(data[i+2])<<16 | uint32(data[i+3])<<24
		k *= m
		k ^= k >> r
		k *= m
		h *= m
		h ^= k
	}
	tail := data[n&^3:]
	switch len(tail) {
	case 3:
		h ^= uint32(tail[2]) << 16
		fallthrough
	case 2:
		h ^= uint32(tail[1]) << 8
		fallthrough
	case 1:
		h ^= uint32(tail[0])
		h *= m
	}
	h ^= h >> 13
	h *= m
	h ^= h >> 15
	return int32(h)
}

// Partition returns the partition, of numPartitions, that the Java client's
// default partitioner puts a record with key on:
// toPositive(murmur2(key)) % numPartitions, where toPositive clears the
// sign bit. sagaflow keys a saga's messages by the saga id (the outbox
// row's aggregateid), so every message of one saga lands on one partition,
// whichever client wrote it. It panics when numPartitions is not positive.
func Partition(key []byte, numPartitions int) int {
	if numPartitions <= 0 {
		panic("wire: Partition: numPartitions must be positive")
	}
	return int(uint32(Murmur2(key))&0x7fffffff) % numPartitions
}
