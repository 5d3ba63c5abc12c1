package main

import (
	"flag"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"
)

// markdownMain prints a report's tables as Markdown, for docs/benchmarks.md.
func markdownMain(args []string) error {
	fs := flag.NewFlagSet("markdown", flag.ExitOnError)
	in := fs.String("in", "results.json", "report written by bench compare")
	_ = fs.Parse(args)
	r, err := readReport(*in)
	if err != nil {
		return err
	}
	writeMarkdown(os.Stdout, r)
	return nil
}

// rng formats a median with the runs' range: "4,012 (3,900–4,100)".
func rng(s Stat, prec int) string {
	if s.N == 0 {
		return "–"
	}
	if s.N == 1 {
		return num(s.Median, prec)
	}
	return fmt.Sprintf("%s (%s–%s)", num(s.Median, prec), num(s.Min, prec), num(s.Max, prec))
}

// num formats with thousands separators.
func num(v float64, prec int) string {
	s := fmt.Sprintf("%.*f", prec, v)
	intPart, frac, _ := strings.Cut(s, ".")
	neg := strings.HasPrefix(intPart, "-")
	intPart = strings.TrimPrefix(intPart, "-")
	var b strings.Builder
	for i, c := range intPart {
		if i > 0 && (len(intPart)-i)%3 == 0 {
			b.WriteByte(',')
		}
		b.WriteRune(c)
	}
	out := b.String()
	if frac != "" {
		out += "." + frac
	}
	if neg {
		out = "-" + out
	}
	return out
}

func med(s Stat, prec int) string {
	if s.N == 0 {
		return "–"
	}
	return num(s.Median, prec)
}

func writeMarkdown(w io.Writer, r *Report) {
	steps := resultsOf(r, scenarioSteps)
	if len(steps) > 0 {
		fmt.Fprintln(w, "| system | best load (sagas in flight) | steps/s, median (min–max) | saga p50 ms | saga p99 ms | CPU s per 1,000 steps | peak memory MiB | runs |")
		fmt.Fprintln(w, "|---|---:|---:|---:|---:|---:|---:|---:|")
		for _, rs := range steps {
			if rs.Best == nil {
				fmt.Fprintf(w, "| %s | – | failed | – | – | – | – | – |\n", rs.System)
				continue
			}
			p := rs.Best
			fmt.Fprintf(w, "| %s | %d | %s | %s | %s | %s | %s | %d |\n", rs.System, p.Param, rng(p.Rate, 0),
				med(p.P50Ms, 1), med(p.P99Ms, 1), rng(p.CPUPer1000, 2), med(p.PeakMemMB, 0), p.Rate.N)
		}
		fmt.Fprintln(w)
		// The curve: steps/s at each load.
		var concs []int
		for _, rs := range steps {
			for _, p := range rs.Points {
				if !slices.Contains(concs, p.Param) {
					concs = append(concs, p.Param)
				}
			}
		}
		slices.Sort(concs)
		fmt.Fprint(w, "| steps/s (median; min–max) |")
		for _, c := range concs {
			fmt.Fprintf(w, " %d in flight |", c)
		}
		fmt.Fprintln(w)
		fmt.Fprint(w, "|---|")
		for range concs {
			fmt.Fprint(w, "---:|")
		}
		fmt.Fprintln(w)
		for _, rs := range steps {
			fmt.Fprintf(w, "| %s |", rs.System)
			for _, c := range concs {
				cell := "not run"
				for _, p := range rs.Points {
					if p.Param == c {
						cell = rng(p.Rate, 0)
						if p.Rate.N == 0 {
							cell = "failed"
						}
					}
				}
				fmt.Fprintf(w, " %s |", cell)
			}
			fmt.Fprintln(w)
		}
		fmt.Fprintln(w)
	}
	if half := resultsOf(r, scenarioHalfLoad); len(half) > 0 {
		fmt.Fprintln(w, "| system | offered steps/s (half of its peak) | achieved steps/s | saga p50 ms | saga p99 ms (min–max) | runs |")
		fmt.Fprintln(w, "|---|---:|---:|---:|---:|---:|")
		for _, rs := range half {
			for _, p := range rs.Points {
				fmt.Fprintf(w, "| %s | %s | %s | %s | %s | %d |\n", rs.System, num(float64(p.Param), 0), med(p.Rate, 0), med(p.P50Ms, 1), rng(p.P99Ms, 1), p.Rate.N)
			}
		}
		fmt.Fprintln(w)
	}
	if hist := resultsOf(r, scenarioHistory); len(hist) > 0 {
		fmt.Fprintln(w, "| finished sagas in the tables | steps/s, median (min–max) | saga p50 ms | saga p99 ms | CPU s per 1,000 steps | runs |")
		fmt.Fprintln(w, "|---:|---:|---:|---:|---:|---:|")
		for _, rs := range hist {
			for _, p := range rs.Points {
				fmt.Fprintf(w, "| %s | %s | %s | %s | %s | %d |\n", num(float64(p.Param), 0), rng(p.Rate, 0), med(p.P50Ms, 1), med(p.P99Ms, 1), med(p.CPUPer1000, 2), p.Rate.N)
			}
		}
		fmt.Fprintln(w)
	}
	relays := append(resultsOf(r, scenarioRelay), resultsOf(r, scenarioDrain)...)
	if len(relays) > 0 {
		fmt.Fprintln(w, "| backlog | system | msgs/s, median (min–max) | CPU s per 1,000 msgs | peak memory MiB | runs | note |")
		fmt.Fprintln(w, "|---:|---|---:|---:|---:|---:|---|")
		for _, rs := range relays {
			for _, p := range rs.Points {
				note := ""
				for _, run := range p.Runs {
					if run.Partial {
						note = run.Note[strings.Index(run.Note, "time-boxed"):]
					}
				}
				fmt.Fprintf(w, "| %s | %s | %s | %s | %s | %d | %s |\n", num(float64(p.Param), 0), rs.System, rng(p.Rate, 0), med(p.CPUPer1000, 3), med(p.PeakMemMB, 0), p.Rate.N, note)
			}
		}
		fmt.Fprintln(w)
	}
	if len(r.Targets) > 0 {
		fmt.Fprintln(w, "| target | wanted | measured | met | from |")
		fmt.Fprintln(w, "|---|---|---:|---|---|")
		for _, t := range r.Targets {
			switch {
			case t.Missing != "":
				fmt.Fprintf(w, "| %s | %s | – | not measured | %s |\n", t.Name, t.Want, t.Missing)
			default:
				met := "**no**"
				if t.Met {
					met = "yes"
				}
				unit := "×"
				if strings.Contains(t.Want, "ms") {
					unit = " ms"
				}
				fmt.Fprintf(w, "| %s | %s | %.2f%s | %s | %s |\n", t.Name, t.Want, t.Got, unit, met, t.Basis)
			}
		}
		fmt.Fprintln(w)
	}
}
