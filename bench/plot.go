package bench

import (
	"encoding/json"
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

// Colours per arm, the same in every panel: greys for the database's own
// floor, red for the naive poller, blue for outboxd, warm colours for the
// peers, greens for the producer paths.
var armColors = map[string]color.Color{
	ArmCeilingInsert:     color.RGBA{R: 150, G: 150, B: 150, A: 255},
	ArmCeilingInsertMark: color.RGBA{R: 95, G: 95, B: 95, A: 255},
	ArmNaivePoller:       color.RGBA{R: 214, G: 39, B: 40, A: 255},
	ArmOutboxd:           color.RGBA{R: 31, G: 119, B: 180, A: 255},
	ArmWatermill:         color.RGBA{R: 255, G: 127, B: 14, A: 255},
	ArmWatermill10ms:     color.RGBA{R: 188, G: 189, B: 34, A: 255},
	ArmRiver:             color.RGBA{R: 148, G: 103, B: 189, A: 255},
	ArmEmit:              color.RGBA{R: 31, G: 119, B: 180, A: 255},
	ArmInsertTrigger:     color.RGBA{R: 44, G: 160, B: 44, A: 255},
}

// panel is one question the plot answers: a plot, and its legend, which is
// drawn below the plot so that it never covers data.
type panel struct {
	p      *plot.Plot
	legend *plot.Legend
}

// WritePlot draws the run as one panel per question: steady throughput per
// arm (peers included), the latency workload's commit→sink CDFs (peers
// included), drain and hot throughput, the producer's cost, held-xmin
// against steady, and steady CPU per event by process. Panels whose
// workload did not run are left out. The file's extension picks PNG (the
// default to read) or SVG.
func (r *Report) WritePlot(path string) error {
	ext := strings.ToLower(filepath.Ext(path))
	if ext != ".svg" && ext != ".png" {
		return fmt.Errorf("bench: plot %s: the name must end in .png or .svg", path)
	}
	var panels []panel
	for _, pn := range []panel{
		r.steadyPanel(), r.latencyPanel(), r.drainHotPanel(), r.producerPanel(), r.heldXminPanel(), r.cpuPanel(),
	} {
		if pn.p != nil {
			panels = append(panels, pn)
		}
	}
	if len(panels) == 0 {
		return fmt.Errorf("bench: plot %s: no results to draw", path)
	}
	const cols = 2
	rows := (len(panels) + cols - 1) / cols
	width, height := 40*vg.Centimeter, vg.Length(rows)*15*vg.Centimeter
	var (
		canvas vg.CanvasSizer
		write  func(io.Writer) error
	)
	if ext == ".svg" {
		c := vgsvg.New(width, height)
		canvas, write = c, func(w io.Writer) error { _, err := c.WriteTo(w); return err }
	} else {
		c := vgimg.NewWith(vgimg.UseWH(width, height), vgimg.UseDPI(110))
		canvas, write = c, func(w io.Writer) error { _, err := (vgimg.PngCanvas{Canvas: c}).WriteTo(w); return err }
	}
	dc := draw.New(canvas)
	// A white background, so the PNG reads on a dark page too.
	dc.SetColor(color.White)
	dc.Fill(dc.Rectangle.Path())
	tiles := draw.Tiles{Rows: rows, Cols: cols, PadTop: vg.Centimeter / 2, PadBottom: vg.Centimeter / 2,
		PadLeft: vg.Centimeter / 2, PadRight: vg.Centimeter / 2, PadX: 1.5 * vg.Centimeter, PadY: vg.Centimeter}
	for i, pn := range panels {
		pn.draw(tiles.At(dc, i%cols, i/cols))
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

// draw draws the plot, and its legend in a strip of its own below it.
func (pn panel) draw(c draw.Canvas) {
	if pn.legend == nil {
		pn.p.Draw(c)
		return
	}
	r := pn.legend.Rectangle(c)
	strip := r.Max.Y - r.Min.Y + vg.Points(6)
	pn.p.Draw(draw.Crop(c, 0, 0, strip, 0))
	legendArea := draw.Crop(c, 0, 0, 0, -(c.Max.Y - c.Min.Y - strip))
	pn.legend.Draw(legendArea)
}

func newLegend() *plot.Legend {
	l := plot.NewLegend()
	l.Left, l.Top = true, true
	l.Padding = vg.Points(2)
	return &l
}

// bar is one horizontal bar of a panel.
type bar struct {
	label string
	value float64
	arm   string
	// text is printed at the bar's end; empty prints the value.
	text string
}

// barPlot draws bars top to bottom in the order given, each labelled on the
// axis and with its value at its end. The axis leaves room past the longest
// bar for its value.
func barPlot(title, xLabel string, bars []bar) *plot.Plot {
	p := plot.New()
	p.Title.Text = title
	p.X.Label.Text = xLabel
	p.X.Min = 0
	labels := make([]string, len(bars))
	largest := 0.0
	for i, b := range bars {
		pos := len(bars) - 1 - i // the first bar on top
		labels[pos] = b.label
		v := b.value
		if math.IsNaN(v) {
			v = 0
		}
		largest = max(largest, v)
		bc, err := plotter.NewBarChart(plotter.Values{v}, vg.Points(12))
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
		texts := make([]string, len(bars))
		for i, b := range bars {
			values[len(bars)-1-i], texts[len(bars)-1-i] = b.value, b.text
		}
		addValueLabels(p, values, texts, math.Inf(1))
	}
	if largest > 0 {
		p.X.Max = largest * 1.3
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

// addValueLabels writes each bar's value (or its text) just past its end
// (bars at y = 0, 1, ...); a bar cut off at clipAt shows its value at the
// edge instead, with an arrow.
func addValueLabels(p *plot.Plot, values []float64, texts []string, clipAt float64) {
	var xyl plotter.XYLabels
	for i, v := range values {
		if math.IsNaN(v) || v < 0 {
			continue
		}
		label := strconv.FormatFloat(v, 'f', 0, 64)
		if i < len(texts) && texts[i] != "" {
			label = texts[i]
		}
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
	for i := range labels.TextStyle {
		labels.TextStyle[i].YAlign = draw.YCenter
	}
	labels.Offset = vg.Point{X: vg.Points(4)}
	p.Add(labels)
}

// armLabel names a result on an axis: the arm and its sink latency.
func armLabel(res *Result) string {
	label := res.Arm
	if res.SinkLatencyMs != nil && res.Arm != ArmCeilingInsert && res.Arm != ArmCeilingInsertMark {
		label += ", sink " + fmtMs(*res.SinkLatencyMs)
	}
	return label
}

func (r *Report) steadyPanel() panel {
	var bars []bar
	var ceiling float64
	if c := r.find(WorkloadSteady, ArmCeilingInsert, 0, 0); c != nil {
		ceiling = c.Throughput
	}
	for _, res := range r.Results {
		if res.Workload != WorkloadSteady {
			continue
		}
		text := ""
		if ceiling > 0 {
			text = fmt.Sprintf("%.0f  (%.2f×)", res.Throughput, res.Throughput/ceiling)
		}
		bars = append(bars, bar{label: armLabel(res), value: res.Throughput, arm: res.Arm, text: text})
	}
	if len(bars) == 0 {
		return panel{}
	}
	return panel{p: barPlot(fmt.Sprintf("Steady: events/s delivered (P=%d, K=%d)", r.Settings.Producers, r.Settings.Relays),
		"events/s (× ceiling-insert)", bars)}
}

func (r *Report) drainHotPanel() panel {
	var bars []bar
	for _, res := range r.Results {
		switch res.Workload {
		case WorkloadDrain:
			bars = append(bars, bar{label: fmt.Sprintf("%s, drain %s", res.Arm, fmtCount(res.Backlog)), value: res.Throughput, arm: res.Arm})
		case WorkloadHot:
			bars = append(bars, bar{label: res.armName() + ", hot aggregate", value: res.Throughput, arm: res.Arm})
		case WorkloadHotDrain:
			bars = append(bars, bar{label: fmt.Sprintf("%s, hot aggregate backlog %s", res.armName(), fmtCount(res.Backlog)), value: res.Throughput, arm: res.Arm})
		}
	}
	if len(bars) == 0 {
		return panel{}
	}
	return panel{p: barPlot("Drain a backlog, and one hot aggregate: events/s", "events/s", bars)}
}

// producerPanel shows what each producer path commits per second, with its
// ratio to a plain INSERT.
func (r *Report) producerPanel() panel {
	plain := r.find(WorkloadProducer, ArmCeilingInsert, 0, 0)
	var bars []bar
	for _, res := range r.Results {
		if res.Workload != WorkloadProducer {
			continue
		}
		name := map[string]string{
			ArmCeilingInsert: "plain INSERT", ArmEmit: "outbox.emit", ArmInsertTrigger: "client.Emit (INSERT, trigger)",
		}[res.Arm]
		text := ""
		if plain != nil && plain.Throughput > 0 {
			text = fmt.Sprintf("%.0f  (%.2f×)", res.Throughput, res.Throughput/plain.Throughput)
		}
		bars = append(bars, bar{label: name, value: res.Throughput, arm: res.Arm, text: text})
	}
	if len(bars) == 0 {
		return panel{}
	}
	return panel{p: barPlot(fmt.Sprintf("Producer cost: commits/s, nothing delivering (P=%d)", r.Settings.Producers),
		"commits/s (× plain INSERT)", bars)}
}

// heldXminPanel puts each held-xmin run under the same arm's steady run.
func (r *Report) heldXminPanel() panel {
	var bars []bar
	seen := map[string]bool{}
	for _, res := range r.Results {
		if res.Workload != WorkloadHeldXmin {
			continue
		}
		sink := durationMs(orZero(res.SinkLatencyMs))
		steady := r.find(WorkloadSteady, res.Arm, sink, 0)
		if steady != nil && !seen[res.Arm] {
			seen[res.Arm] = true
			bars = append(bars, bar{label: res.Arm + ", steady", value: steady.Throughput, arm: res.Arm})
		}
		text := ""
		if steady != nil && steady.Throughput > 0 {
			text = fmt.Sprintf("%.0f  (%.2f×)", res.Throughput, res.Throughput/steady.Throughput)
		}
		bars = append(bars, bar{label: res.Arm + ", xmin held " + res.Holder, value: res.Throughput, arm: res.Arm, text: text})
	}
	if len(bars) == 0 {
		return panel{}
	}
	slices.SortStableFunc(bars, func(a, b bar) int { return strings.Compare(a.arm, b.arm) })
	return panel{p: barPlot("Held xmin: events/s against the same arm's steady run", "events/s (× steady)", bars)}
}

// cpuPanel stacks each steady arm's CPU per 1,000 events by process.
func (r *Report) cpuPanel() panel {
	var rows []*Result
	for _, res := range r.Results {
		if res.Workload == WorkloadSteady {
			rows = append(rows, res)
		}
	}
	if len(rows) == 0 {
		return panel{}
	}
	p := plot.New()
	p.Title.Text = "Steady: CPU ms per 1,000 events, by process"
	p.X.Label.Text = "CPU ms / 1,000 events"
	p.X.Min = 0
	legend := newLegend()
	parts := []struct {
		name  string
		color color.Color
		value func(*Result) float64
	}{
		{"PostgreSQL", color.RGBA{R: 44, G: 160, B: 44, A: 255}, func(res *Result) float64 { return orZero(res.CPU.PostgresMsPer1k) }},
		{"outboxd server", color.RGBA{R: 31, G: 119, B: 180, A: 255}, func(res *Result) float64 { return orZero(res.CPU.ServerMsPer1k) }},
		{"bench process (producers, relays or peer consumers, sink)", color.RGBA{R: 255, G: 127, B: 14, A: 255},
			func(res *Result) float64 { return orZero(&res.CPU.BenchMsPer1k) }},
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
			labels[pos] = armLabel(res)
		}
		bc, err := plotter.NewBarChart(vals, vg.Points(12))
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
		legend.Add(part.name, bc)
	}
	p.NominalY(labels...)
	// One arm can cost a hundred times the others: cut the axis after the
	// largest total within 5x the median so the rest stay readable; every
	// bar's value is printed, the cut ones with an arrow.
	clip := math.Inf(1)
	sorted := slices.Sorted(slices.Values(totals))
	largest := sorted[len(sorted)-1]
	if median := sorted[len(sorted)/2]; median > 0 && largest > 5*median {
		for _, t := range sorted {
			if t <= 5*median {
				clip = t
			}
		}
		largest = clip
	}
	if largest > 0 {
		p.X.Max = largest * 1.3
	}
	addValueLabels(p, totals, nil, clip)
	p.X.Tick.Marker = wholeTicks
	p.Add(plotter.NewGrid())
	return panel{p: p, legend: legend}
}

// latencyPanel draws the latency workload's commit→sink distributions on a
// log scale, one line per arm, and outboxd's commit→published_at dashed.
func (r *Report) latencyPanel() panel {
	p := plot.New()
	rate := 0.0
	p.X.Label.Text = "ms after the producer's commit (log scale)"
	p.Y.Label.Text = "fraction of events"
	p.Y.Min, p.Y.Max = 0, 1
	legend := newLegend()
	lines := 0
	for _, res := range r.Results {
		if res.Workload != WorkloadLatency {
			continue
		}
		rate = res.TargetRate
		for _, series := range []struct {
			points []CDFPoint
			dashed bool
			name   string
		}{{res.CDFSink, false, res.Arm + ": commit→sink"}, {res.CDFPublished, true, res.Arm + ": commit→published_at"}} {
			if len(series.points) == 0 || (series.dashed && res.Arm != ArmOutboxd) {
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
			}
			p.Add(line)
			legend.Add(series.name, line)
			lines++
		}
	}
	if lines == 0 {
		return panel{}
	}
	p.Title.Text = fmt.Sprintf("Latency at half load (%.0f events/s open loop): CDF", rate)
	p.X.Scale = plot.LogScale{}
	p.X.Tick.Marker = plot.LogTicks{Prec: -1}
	p.Add(plotter.NewGrid())
	return panel{p: p, legend: legend}
}

func orZero(v *float64) float64 {
	if v == nil || math.IsNaN(*v) {
		return 0
	}
	return *v
}

// ReadReport reads a report WriteJSON wrote, to draw it again.
func ReadReport(path string) (*Report, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var r Report
	if err := json.Unmarshal(b, &r); err != nil {
		return nil, fmt.Errorf("bench: %s: %w", path, err)
	}
	return &r, nil
}
