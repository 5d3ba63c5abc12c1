package main

import "testing"

func TestComputeTargets(t *testing.T) {
	s := func(sys, sc string, conc, param int, rate, p99 float64) Sample {
		x := Sample{System: sys, Scenario: sc, Conc: conc, Rep: 1, Rate: rate, P50Ms: p99 / 2, P99Ms: p99, Latency: 1}
		switch sc {
		case scenarioHistory:
			x.History = param
		case scenarioRelay, scenarioDrain:
			x.Backlog, x.Conc = param, 0
		case scenarioHalfLoad:
			x.OfferedRate = float64(param)
		}
		return x
	}
	res := group([]Sample{
		s(sysSagaflowPG, scenarioSteps, 16, 0, 4000, 0),
		s(sysSagaflowPG, scenarioSteps, 256, 0, 5000, 0), // best
		s(sysRiver, scenarioSteps, 256, 0, 6000, 0),
		s(sysTemporal, scenarioSteps, 16, 0, 400, 0),
		s(sysRaw, scenarioSteps, 16, 0, 4000, 0),
		s(sysRawPipelined, scenarioSteps, 256, 0, 10000, 0),
		s(sysDBOS, scenarioSteps, 16, 0, 2000, 0),
		s(sysSagaflowKafka, scenarioSteps, 256, 0, 2000, 0),
		s(sysSagaflowPG, scenarioHalfLoad, 0, 2500, 2500, 40),
		s(sysSagaflowPG, scenarioHistory, 256, 0, 5000, 0),
		s(sysSagaflowPG, scenarioHistory, 256, 1000000, 4400, 0),
		s(sysRelay, scenarioRelay, 0, 20000, 10000, 0),
		s(sysWatermill, scenarioRelay, 0, 20000, 6000, 0),
		s(sysKafkaGo, scenarioRelay, 0, 20000, 18000, 0),
	})
	got := map[string]Target{}
	for _, tg := range computeTargets(res) {
		got[tg.Name] = tg
	}
	check := func(name string, want float64, met bool) {
		t.Helper()
		tg, ok := got[name]
		if !ok {
			t.Fatalf("no target %q in %v", name, got)
		}
		if tg.Missing != "" || tg.Met != met || tg.Got < want-1e-9 || tg.Got > want+1e-9 {
			t.Errorf("%s: got %+v, want %.4f met=%v", name, tg, want, met)
		}
	}
	check("sagaflow-pg ÷ river, steps/s at each one's best concurrency", 5000.0/6000, false)
	check("sagaflow-pg ÷ temporal, steps/s at each one's best concurrency", 12.5, true)
	check("sagaflow-pg ÷ dbos, steps/s at each one's best concurrency", 2.5, true)
	check("sagaflow-pg ÷ raw, steps/s at each one's best concurrency", 1.25, true)
	check("sagaflow-pg ÷ raw-pipelined, steps/s at each one's best concurrency", 0.5, false)
	check("sagaflow-kafka ÷ sagaflow-pg, steps/s at each one's best concurrency", 0.4, false)
	check("relay ÷ watermill, 20000-row backlog", 10000.0/6000, false)
	check("relay ÷ kafka-go, 20000-row backlog", 10000.0/18000, false)
	check("sagaflow-pg p99 saga latency (3 steps) at half of peak throughput", 40, true)
	check("sagaflow-pg steps/s with the largest finished history ÷ with an empty database", 0.88, false)
}

func TestComputeTargetsSaysWhatIsMissing(t *testing.T) {
	for _, tg := range computeTargets(nil) {
		if tg.Missing == "" {
			t.Errorf("%s: computed from nothing: %+v", tg.Name, tg)
		}
	}
}
