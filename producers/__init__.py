"""Ways into Kafka: agent SDK, HTTP gateway, JSONL replay, outbox relay."""
