"""Benchmarks: `bench serve` measures any OpenAI-compatible server the way public leaderboards measure providers;
`bench throughput` measures the offline engine against transformers on the same machine."""
