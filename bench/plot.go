package bench

import (
	"fmt"
	"image/color"
	"io"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgimg"
	"gonum.org/v1/plot/vg/vgsvg"
)

// Colours per arm, the same in every panel.
var armColors = map[string]color.Color{
	ArmCeilingInsert:     color.RGBA{R: 150, G: 150, B: 150, A: 255},
	ArmCeilingInsertMark: color.RGBA{R: 95, G: 95, B: 95, A: 255},
	ArmNaivePoller:       color.RGBA{R: 214, G: 39, B: 40, A: 255},
	ArmOutboxd:           color.RGBA{R: 31, G: 119, B: 180, A: 255},
}

// WritePlot draws the run as four panels: steady throughput per arm, the
// latency workload's CDFs, drain and hot throughput, and steady CPU per
// event split by process. The file's extension picks SVG or PNG.
func (r *Report) WritePlot(path string) error {
	ext := strings.ToLower(filepath.Ext(path))
	if ext != ".svg" && ext != ".png" {
		return fmt.Errorf("bench: plot %s: the name must end in .svg or .png", path)
	}
	panels := [][]*plot.Plot{
		{r.steadyPlot(), r.latencyPlot()},
		{r.drainHotPlot(), r.cpuPlot()},
	}
	const width, height = 36 * vg.Centimeter, 26 * vg.Centimeter
	var (
		canvas vg.CanvasSizer
		write  func(io.Writer) error
	)
	if ext == ".svg" {
		c := vgsvg.New(width, height)
		canvas, write = c, func(w io.Writer) error { _, err := c.WriteTo(w); return err }
	} else {
		c := vgimg.New(width, height)
		canvas, write = c, func(w io.Writer) error { _, err := (vgimg.PngCanvas{Canvas: c}).WriteTo(w); return err }
	}
	dc := draw.New(canvas)
	// A white background, so the PNG reads on a dark page too.
	dc.SetColor(color.White)
	dc.Fill(dc.Rectangle.Path())
	tiles := draw.Tiles{Rows: 2, Cols: 2, PadTop: vg.Centimeter / 2, PadBottom: vg.Centimeter / 2,
		PadLeft: vg.Centimeter / 2, PadRight: vg.Centimeter / 2, PadX: vg.Centimeter, PadY: vg.Centimeter}
	canvases := plot.Align(panels, tiles, dc)
	for i := range panels {
		for j := range panels[i] {
			panels[i][j].Draw(canvases[i][j])
		}
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if err := write(f); err != nil {
		f.Close()
		return fmt.Errorf("bench: write plot: %w", err)
	}
	return f.Close()
}

// bar is one horizontal bar of a panel.
type bar struct {
	label string
	value float64
	arm   string
}

// barPlot draws bars top to bottom in the order given.
func barPlot(title, xLabel string, bars []bar) *plot.Plot {
	p := plot.New()
	p.Title.Text = title
	p.X.Label.Text = xLabel
	p.X.Min = 0
	labels := make([]string, len(bars))
	for i, b := range bars {
		pos := len(bars) - 1 - i // the first bar on top
		labels[pos] = b.label
		v := b.value
		if math.IsNaN(v) {
			v = 0
		}
		bc, err := plotter.NewBarChart(plotter.Values{v}, vg.Points(14))
		if err != nil {
			continue
		}
		bc.Horizontal = true
		bc.XMin = float64(pos)
		bc.Color = armColors[b.arm]
		bc.LineStyle.Width = 0
		p.Add(bc)
	}
	if len(bars) > 0 {
		p.NominalY(labels...)
		values := make([]float64, len(bars))
		for i, b := range bars {
			values[len(bars)-1-i] = b.value
		}
		addValueLabels(p, values, math.Inf(1))
	}
	p.X.Tick.Marker = wholeTicks
	p.Add(plotter.NewGrid())
	return p
}

// wholeTicks labels an axis of counts without decimals.
var wholeTicks = plot.TickerFunc(func(min, max float64) []plot.Tick {
	ticks := plot.DefaultTicks{}.Ticks(min, max)
	for i := range ticks {
		if ticks[i].Label != "" {
			ticks[i].Label = strconv.FormatFloat(ticks[i].Value, 'f', 0, 64)
		}
	}
	return ticks
})

// addValueLabels writes each bar's value at its end (bars at y = 0, 1, ...);
// a bar cut off at clipAt shows its value at the edge instead.
func addValueLabels(p *plot.Plot, values []float64, clipAt float64) {
	var xyl plotter.XYLabels
	for i, v := range values {
		if math.IsNaN(v) || v <= 0 {
			continue
		}
		label := strconv.FormatFloat(v, 'f', 0, 64)
		x := v
		if v > clipAt {
			x, label = clipAt, label+" →"
		}
		xyl.XYs = append(xyl.XYs, plotter.XY{X: x, Y: float64(i)})
		xyl.Labels = append(xyl.Labels, label)
	}
	if len(xyl.XYs) == 0 {
		return
	}
	labels, err := plotter.NewLabels(xyl)
	if err != nil {
		return
	}
	labels.Offset = vg.Point{X: vg.Points(3), Y: -vg.Points(4)}
	p.Add(labels)
}

func (r *Report) steadyPlot() *plot.Plot {
	var bars []bar
	for _, res := range r.Results {
		if res.Workload == WorkloadSteady {
			label := res.Arm
			if res.SinkLatencyMs != nil {
				label += ", sink " + fmtMs(*res.SinkLatencyMs)
			}
			bars = append(bars, bar{label: label, value: res.Throughput, arm: res.Arm})
		}
	}
	return barPlot(fmt.Sprintf("steady: events/s delivered (P=%d, K=%d)", r.Settings.Producers, r.Settings.Relays), "events/s", bars)
}

func (r *Report) drainHotPlot() *plot.Plot {
	var bars []bar
	for _, res := range r.Results {
		switch res.Workload {
		case WorkloadDrain:
			bars = append(bars, bar{label: fmt.Sprintf("%s, drain %s", res.Arm, fmtCount(res.Backlog)), value: res.Throughput, arm: res.Arm})
		case WorkloadHot:
			bars = append(bars, bar{label: res.Arm + ", hot aggregate", value: res.Throughput, arm: res.Arm})
		}
	}
	return barPlot("drain and hot aggregate: events/s (sink 0)", "events/s", bars)
}

// cpuPlot stacks each steady arm's CPU per 1,000 events by process.
func (r *Report) cpuPlot() *plot.Plot {
	p := plot.New()
	p.Title.Text = "steady: CPU ms per 1,000 events"
	p.X.Label.Text = "CPU ms / 1,000 events"
	p.X.Min = 0
	var rows []*Result
	for _, res := range r.Results {
		if res.Workload == WorkloadSteady {
			rows = append(rows, res)
		}
	}
	if len(rows) == 0 {
		return p
	}
	parts := []struct {
		name  string
		color color.Color
		value func(*Result) float64
	}{
		{"postgres", color.RGBA{R: 44, G: 160, B: 44, A: 255}, func(res *Result) float64 { return orZero(res.CPU.PostgresMsPer1k) }},
		{"server", color.RGBA{R: 31, G: 119, B: 180, A: 255}, func(res *Result) float64 { return orZero(res.CPU.ServerMsPer1k) }},
		{"bench process (producers, relays, sink)", color.RGBA{R: 255, G: 127, B: 14, A: 255}, func(res *Result) float64 { return orZero(&res.CPU.BenchMsPer1k) }},
	}
	labels := make([]string, len(rows))
	totals := make([]float64, len(rows))
	var below *plotter.BarChart
	for _, part := range parts {
		vals := make(plotter.Values, len(rows))
		for i, res := range rows {
			pos := len(rows) - 1 - i
			vals[pos] = part.value(res)
			totals[pos] += vals[pos]
			labels[pos] = res.Arm
			if res.SinkLatencyMs != nil {
				labels[pos] += ", sink " + fmtMs(*res.SinkLatencyMs)
			}
		}
		bc, err := plotter.NewBarChart(vals, vg.Points(14))
		if err != nil {
			continue
		}
		bc.Horizontal = true
		bc.Color = part.color
		bc.LineStyle.Width = 0
		if below != nil {
			bc.StackOn(below)
		}
		below = bc
		p.Add(bc)
		p.Legend.Add(part.name, bc)
	}
	p.Legend.Top = true
	p.NominalY(labels...)
	// One arm can cost a hundred times the others: cut the axis after the
	// largest total within 5x the median so the rest stay readable; every
	// bar's value is printed, the cut ones with an arrow.
	clip := math.Inf(1)
	sorted := slices.Sorted(slices.Values(totals))
	if median := sorted[len(sorted)/2]; median > 0 && sorted[len(sorted)-1] > 5*median {
		for _, t := range sorted {
			if t <= 5*median {
				clip = t
			}
		}
		p.X.Max = clip * 1.3
	}
	addValueLabels(p, totals, clip)
	p.X.Tick.Marker = wholeTicks
	p.Add(plotter.NewGrid())
	return p
}

// latencyPlot draws the latency workload's commit→published_at (solid) and
// commit→sink (dashed) distributions on a log scale.
func (r *Report) latencyPlot() *plot.Plot {
	p := plot.New()
	p.Title.Text = "latency at half load: CDF (solid commit→published_at, dashed commit→sink)"
	p.X.Label.Text = "ms (log scale)"
	p.Y.Label.Text = "fraction of events"
	p.Y.Min, p.Y.Max = 0, 1
	lines := 0
	for _, res := range r.Results {
		if res.Workload != WorkloadLatency {
			continue
		}
		for _, series := range []struct {
			points []CDFPoint
			dashed bool
		}{{res.CDFPublished, false}, {res.CDFSink, true}} {
			if len(series.points) == 0 {
				continue
			}
			xys := make(plotter.XYs, len(series.points))
			for i, pt := range series.points {
				// A log axis cannot show 0: the axis starts at 0.1ms and
				// faster samples sit on it.
				xys[i] = plotter.XY{X: math.Max(pt.Ms, 0.1), Y: pt.Fraction}
			}
			line, err := plotter.NewLine(xys)
			if err != nil {
				continue
			}
			line.Color = armColors[res.Arm]
			line.Width = vg.Points(1.5)
			if series.dashed {
				line.Dashes = []vg.Length{vg.Points(4), vg.Points(3)}
			} else {
				p.Legend.Add(fmt.Sprintf("%s at %.0f ev/s", res.Arm, res.TargetRate), line)
			}
			p.Add(line)
			lines++
		}
	}
	if lines > 0 { // a log axis over no data has no range to draw
		p.X.Scale = plot.LogScale{}
		p.X.Tick.Marker = plot.LogTicks{Prec: -1}
	}
	p.Legend.Left = false
	p.Legend.Top = false
	p.Legend.XOffs = -vg.Centimeter / 2
	p.Legend.YOffs = vg.Centimeter
	p.Add(plotter.NewGrid())
	return p
}

func orZero(v *float64) float64 {
	if v == nil || math.IsNaN(*v) {
		return 0
	}
	return *v
}
