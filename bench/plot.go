package main

import (
	"flag"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strconv"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/plotutil"
	"gonum.org/v1/plot/vg"
)

func plotMain(args []string) error {
	fs := flag.NewFlagSet("plot", flag.ExitOnError)
	in := fs.String("in", "results.json", "report written by bench compare")
	out := fs.String("out", ".", "directory for the PNGs")
	_ = fs.Parse(args)
	r, err := readReport(*in)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(*out, 0o755); err != nil {
		return err
	}
	files, err := drawAll(r, *out)
	for _, f := range files {
		fmt.Fprintln(os.Stderr, "wrote", f)
	}
	return err
}

// drawAll draws every plot the report has data for and returns the files
// it wrote.
func drawAll(r *Report, dir string) ([]string, error) {
	var files []string
	for _, d := range []struct {
		name string
		draw func(*Report) (*plot.Plot, bool, error)
	}{
		{"concurrency.png", plotConcurrency},
		{"latency.png", plotLatency},
		{"history.png", plotHistory},
		{"relay-drain.png", plotDrain},
	} {
		p, ok, err := d.draw(r)
		if err != nil {
			return files, fmt.Errorf("%s: %w", d.name, err)
		}
		if !ok {
			continue
		}
		path := filepath.Join(dir, d.name)
		if err := p.Save(8*vg.Inch, 5*vg.Inch, path); err != nil {
			return files, err
		}
		files = append(files, path)
	}
	return files, nil
}

func resultsOf(r *Report, scenario string) []Result {
	var out []Result
	for _, res := range r.Results {
		if res.Scenario == scenario {
			out = append(out, res)
		}
	}
	return out
}

// errPoints are medians with min–max bars.
type errPoints struct {
	plotter.XYs
	plotter.YErrors
}

func medianPoints(points []Point) errPoints {
	var e errPoints
	for _, p := range points {
		if p.Rate.N == 0 {
			continue
		}
		e.XYs = append(e.XYs, plotter.XY{X: float64(p.Param), Y: p.Rate.Median})
		e.YErrors = append(e.YErrors, struct{ Low, High float64 }{p.Rate.Median - p.Rate.Min, p.Rate.Max - p.Rate.Median})
	}
	return e
}

func caption(r *Report) string {
	return fmt.Sprintf("%s, %d cores; medians, bars min–max", r.Date[:10], r.Machine.Cores)
}

// plotConcurrency: steps/s against sagas in flight, one line per system.
func plotConcurrency(r *Report) (*plot.Plot, bool, error) {
	res := resultsOf(r, scenarioSteps)
	if len(res) == 0 {
		return nil, false, nil
	}
	p := plot.New()
	p.Title.Text = "3-step sagas: throughput against sagas in flight"
	p.X.Label.Text = "sagas in flight (" + caption(r) + ")"
	p.Y.Label.Text = "steps/s"
	p.X.Scale = plot.LogScale{}
	p.X.Tick.Marker = plot.ConstantTicks(powerTicks(res))
	p.Y.Min = 0
	p.Legend.Top = true
	p.Legend.Left = true
	p.Legend.XOffs = vg.Points(10)
	ymax := 0.0
	for _, rs := range res {
		for _, pt := range rs.Points {
			ymax = max(ymax, pt.Rate.Max)
		}
	}
	p.Y.Max = ymax * 1.35 // room for the legend
	for i, rs := range res {
		e := medianPoints(rs.Points)
		if len(e.XYs) == 0 {
			continue
		}
		l, s, err := plotter.NewLinePoints(e.XYs)
		if err != nil {
			return nil, false, err
		}
		l.Color, s.Color = plotutil.Color(i), plotutil.Color(i)
		s.Shape = plotutil.Shape(i)
		bars, err := plotter.NewYErrorBars(e)
		if err != nil {
			return nil, false, err
		}
		bars.Color = plotutil.Color(i)
		p.Add(l, s, bars)
		p.Legend.Add(rs.System, l, s)
	}
	return p, true, nil
}

func powerTicks(res []Result) []plot.Tick {
	seen := map[int]bool{}
	var ticks []plot.Tick
	for _, rs := range res {
		for _, pt := range rs.Points {
			if !seen[pt.Param] && pt.Param > 0 {
				seen[pt.Param] = true
				ticks = append(ticks, plot.Tick{Value: float64(pt.Param), Label: strconv.Itoa(pt.Param)})
			}
		}
	}
	return ticks
}

// plotLatency: p50 and p99 saga latency at half of each system's peak,
// as points on a log scale (the systems differ by orders of magnitude).
func plotLatency(r *Report) (*plot.Plot, bool, error) {
	res := resultsOf(r, scenarioHalfLoad)
	if len(res) == 0 {
		return nil, false, nil
	}
	p := plot.New()
	p.Title.Text = "Saga latency (3 steps) at half of each system's peak throughput"
	p.Y.Label.Text = "ms (log scale)"
	p.X.Label.Text = caption(r)
	p.Y.Scale = plot.LogScale{}
	p.Y.Tick.Marker = logTicks125{}
	var names []string
	var p50, p99 errPoints
	for _, rs := range res {
		if len(rs.Points) == 0 || rs.Points[0].P50Ms.N == 0 {
			continue
		}
		pt := rs.Points[0]
		x := float64(len(names))
		names = append(names, rs.System)
		for _, v := range []struct {
			e *errPoints
			s Stat
		}{{&p50, pt.P50Ms}, {&p99, pt.P99Ms}} {
			v.e.XYs = append(v.e.XYs, plotter.XY{X: x, Y: max(v.s.Median, 0.01)})
			v.e.YErrors = append(v.e.YErrors, struct{ Low, High float64 }{v.s.Median - max(v.s.Min, 0.01), v.s.Max - v.s.Median})
		}
	}
	if len(names) == 0 {
		return nil, false, nil
	}
	for i, e := range []errPoints{p50, p99} {
		sc, err := plotter.NewScatter(e.XYs)
		if err != nil {
			return nil, false, err
		}
		sc.Color = plotutil.Color(i)
		sc.Shape = plotutil.Shape(i)
		sc.Radius = vg.Points(4)
		bars, err := plotter.NewYErrorBars(e)
		if err != nil {
			return nil, false, err
		}
		bars.Color = plotutil.Color(i)
		p.Add(sc, bars)
		p.Legend.Add([]string{"p50", "p99"}[i], sc)
	}
	p.Add(plotter.NewGrid())
	p.Legend.Top = true
	p.Legend.Left = true
	p.NominalX(names...)
	p.X.Min, p.X.Max = -0.5, float64(len(names))-0.5
	return p, true, nil
}

// plotHistory: sagaflow's steps/s with finished sagas in its tables.
func plotHistory(r *Report) (*plot.Plot, bool, error) {
	res := resultsOf(r, scenarioHistory)
	if len(res) == 0 || len(res[0].Points) == 0 {
		return nil, false, nil
	}
	rs := res[0]
	p := plot.New()
	p.Title.Text = "sagaflow (Postgres-only): throughput with finished sagas in the tables"
	p.Y.Label.Text = "steps/s"
	p.X.Label.Text = fmt.Sprintf("finished sagas in the tables; %d in flight (%s)", rs.Points[0].Conc, caption(r))
	var vals plotter.Values
	var lows, highs []float64
	var names []string
	for _, pt := range rs.Points {
		vals = append(vals, pt.Rate.Median)
		lows = append(lows, pt.Rate.Median-pt.Rate.Min)
		highs = append(highs, pt.Rate.Max-pt.Rate.Median)
		names = append(names, humanCount(pt.Param))
	}
	b, err := plotter.NewBarChart(vals, vg.Points(40))
	if err != nil {
		return nil, false, err
	}
	b.Color = plotutil.Color(0)
	p.Add(b)
	var e errPoints
	for i, v := range vals {
		e.XYs = append(e.XYs, plotter.XY{X: float64(i), Y: v})
		e.YErrors = append(e.YErrors, struct{ Low, High float64 }{lows[i], highs[i]})
	}
	bars, err := plotter.NewYErrorBars(e)
	if err != nil {
		return nil, false, err
	}
	p.Add(bars)
	p.NominalX(names...)
	p.X.Min, p.X.Max = -0.5, float64(len(names))-0.5
	p.Y.Min = 0
	return p, true, nil
}

// plotDrain: msgs/s of each relay system, per backlog size.
func plotDrain(r *Report) (*plot.Plot, bool, error) {
	res := append(resultsOf(r, scenarioRelay), resultsOf(r, scenarioDrain)...)
	if len(res) == 0 {
		return nil, false, nil
	}
	// Columns: one per backlog size; bars: one per system.
	var backlogs []int
	var ymax float64
	systems := []string{}
	rate := map[string]map[int]float64{}
	for _, rs := range res {
		if rate[rs.System] == nil {
			rate[rs.System] = map[int]float64{}
			systems = append(systems, rs.System)
		}
		for _, pt := range rs.Points {
			rate[rs.System][pt.Param] = pt.Rate.Median
			ymax = max(ymax, pt.Rate.Median)
			seen := false
			for _, b := range backlogs {
				seen = seen || b == pt.Param
			}
			if !seen {
				backlogs = append(backlogs, pt.Param)
			}
		}
	}
	p := plot.New()
	p.Title.Text = "Outbox to Kafka: drain rate from a backlog"
	p.Y.Label.Text = "msgs/s"
	p.X.Label.Text = "rows in the backlog (" + caption(r) + ")"
	w := vg.Points(20)
	for i, sys := range systems {
		var v plotter.Values
		for _, b := range backlogs {
			v = append(v, rate[sys][b])
		}
		bc, err := plotter.NewBarChart(v, w)
		if err != nil {
			return nil, false, err
		}
		bc.Color = plotutil.Color(i)
		bc.Offset = w * vg.Length(2*i-len(systems)+1) / 2
		p.Add(bc)
		p.Legend.Add(sys, bc)
	}
	var names []string
	for _, b := range backlogs {
		names = append(names, humanCount(b))
	}
	p.NominalX(names...)
	p.X.Min, p.X.Max = -0.5, float64(len(names))-0.5
	p.Legend.Top = true
	p.Legend.Left = true
	p.Legend.XOffs = vg.Points(10)
	p.Y.Min = 0
	p.Y.Max = ymax * 1.3 // room for the legend
	return p, true, nil
}

func humanCount(n int) string {
	switch {
	case n >= 1_000_000 && n%1_000_000 == 0:
		return fmt.Sprintf("%dM", n/1_000_000)
	case n >= 1000 && n%1000 == 0:
		return fmt.Sprintf("%dk", n/1000)
	default:
		return strconv.Itoa(n)
	}
}

// logTicks125 marks 1, 2 and 5 times each power of ten.
type logTicks125 struct{}

func (logTicks125) Ticks(lo, hi float64) []plot.Tick {
	var ticks []plot.Tick
	for p := math.Pow(10, math.Floor(math.Log10(lo))); p <= hi; p *= 10 {
		for _, m := range []float64{1, 2, 5} {
			if v := p * m; v >= lo && v <= hi {
				ticks = append(ticks, plot.Tick{Value: v, Label: strconv.FormatFloat(v, 'g', -1, 64)})
			}
		}
	}
	return ticks
}
