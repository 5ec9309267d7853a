package report

import (
	"bytes"
	"errors"
	"fmt"
	"image/color"
	"math"
	"regexp"
	"strconv"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/font"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgimg"
	"gonum.org/v1/plot/vg/vgsvg"
)

// Chart is a chart with named series over a common x axis. The report's own charts are
// Charts, and callers (replay) add theirs to WriteReport: TTFT vs sharing ratio, one line per
// weight for a weight surface, p90 TTFT vs staleness with the SLO as a reference line…
// Every chart is written as dir/Name.svg and dir/Name.png and inlined in index.html.
type Chart struct {
	Name    string // file stem: lower-case letters, digits, '_' and '-'; unique in a report
	Title   string
	XLabel  string // with the unit, e.g. "staleness (ms)"
	YLabel  string // with the unit, e.g. "p90 TTFT (ms)"
	Caption string // how to read it, one or two sentences under the chart in index.html

	LogX, LogY bool    // log scale; every value on that axis must then be > 0
	YMin, YMax float64 // when YMax > YMin the y axis spans exactly [YMin, YMax]

	// Bars draws the series as grouped bars, Y[i] at category i (X is ignored), labelled
	// Categories[i] when given. Otherwise each series is a line over its X.
	Bars       bool
	Categories []string

	Series []ChartSeries
	Refs   []RefLine // horizontal reference lines (bounds, SLOs, the ideal share)
}

// ChartSeries is one named series. A series named after a policy of the Result gets that
// policy's colour, the same in every chart of the report.
type ChartSeries struct {
	Name   string
	Key    string // colour key when it differs from Name (e.g. Name "ttft (stale)", Key "ttft")
	X, Y   []float64
	Points bool // mark every point (sparse data)
	Step   bool // draw as a step function (an empirical CDF): each value holds until the next x
	Dashed bool
	// YLo and YHi, for bars, draw a whisker from YLo[i] to YHi[i] on bar i (a confidence
	// interval); NaN for none. Nil, or as long as Y.
	YLo, YHi []float64
}

func (s ChartSeries) key() string {
	if s.Key != "" {
		return s.Key
	}
	return s.Name
}

// RefLine is a dashed grey horizontal line at Y, named in the legend.
type RefLine struct {
	Label string
	Y     float64
}

// ErrInvalidChart is returned when a Chart cannot be drawn (bad name, mismatched or
// non-finite data, non-positive values on a log axis).
var ErrInvalidChart = errors.New("report: invalid chart")

var chartName = regexp.MustCompile(`^[a-z0-9][a-z0-9_-]*$`)

func (c Chart) validate() error {
	if !chartName.MatchString(c.Name) {
		return fmt.Errorf("%w: name %q (want [a-z0-9][a-z0-9_-]*)", ErrInvalidChart, c.Name)
	}
	finite := func(v float64) bool { return !math.IsNaN(v) && !math.IsInf(v, 0) }
	for _, s := range c.Series {
		if !c.Bars && len(s.X) != len(s.Y) {
			return fmt.Errorf("%w: %s: series %q has %d x and %d y", ErrInvalidChart, c.Name, s.Name, len(s.X), len(s.Y))
		}
		if (s.YLo != nil || s.YHi != nil) && (!c.Bars || len(s.YLo) != len(s.Y) || len(s.YHi) != len(s.Y)) {
			return fmt.Errorf("%w: %s: series %q: whiskers need bars and one low and one high per y", ErrInvalidChart, c.Name, s.Name)
		}
		for i, y := range s.Y {
			if !finite(y) || (c.LogY && y <= 0) {
				return fmt.Errorf("%w: %s: series %q y[%d] = %v", ErrInvalidChart, c.Name, s.Name, i, y)
			}
			if s.YLo != nil && !math.IsNaN(s.YLo[i]) && !(finite(s.YLo[i]) && finite(s.YHi[i]) && s.YLo[i] <= s.YHi[i] && (!c.LogY || s.YLo[i] > 0)) {
				return fmt.Errorf("%w: %s: series %q whisker %d = [%v, %v]", ErrInvalidChart, c.Name, s.Name, i, s.YLo[i], s.YHi[i])
			}
			if c.Bars {
				continue
			}
			if x := s.X[i]; !finite(x) || (c.LogX && x <= 0) {
				return fmt.Errorf("%w: %s: series %q x[%d] = %v", ErrInvalidChart, c.Name, s.Name, i, x)
			}
		}
	}
	for _, r := range c.Refs {
		if !finite(r.Y) || (c.LogY && r.Y <= 0) {
			return fmt.Errorf("%w: %s: reference %q y = %v", ErrInvalidChart, c.Name, r.Label, r.Y)
		}
	}
	if c.LogY && c.YMax > c.YMin && c.YMin <= 0 {
		return fmt.Errorf("%w: %s: log y axis from %v", ErrInvalidChart, c.Name, c.YMin)
	}
	if c.Bars && c.LogX {
		return fmt.Errorf("%w: %s: bars have no x scale", ErrInvalidChart, c.Name)
	}
	return nil
}

// palette is Tableau 10 followed by six darker hues: distinct on screen and in greyscale
// print for the first ten; beyond ten, colours repeat with a dash pattern (styleFor).
var palette = []color.RGBA{
	{0x1f, 0x77, 0xb4, 0xff}, {0xff, 0x7f, 0x0e, 0xff}, {0x2c, 0xa0, 0x2c, 0xff}, {0xd6, 0x27, 0x28, 0xff},
	{0x94, 0x67, 0xbd, 0xff}, {0x8c, 0x56, 0x4b, 0xff}, {0xe3, 0x77, 0xc2, 0xff}, {0x7f, 0x7f, 0x7f, 0xff},
	{0xbc, 0xbd, 0x22, 0xff}, {0x17, 0xbe, 0xcf, 0xff}, {0x39, 0x3b, 0x79, 0xff}, {0x63, 0x79, 0x39, 0xff},
	{0x8c, 0x6d, 0x31, 0xff}, {0x84, 0x3c, 0x39, 0xff}, {0x7b, 0x41, 0x73, 0xff}, {0x00, 0x00, 0x00, 0xff},
}

// colours assigns each series name a stable index: the Result's policies first, in run
// order, then other names in order of first appearance.
type colours map[string]int

func newColours(res Result) colours {
	c := colours{}
	for _, r := range res.Runs {
		c.index(r.Policy)
	}
	return c
}

func (c colours) index(name string) int {
	if i, ok := c[name]; ok {
		return i
	}
	i := len(c)
	c[name] = i
	return i
}

// styleFor returns the line style of colour index i: palette colour, and a dash pattern
// once the palette has been used once, so that 16+ policies stay distinguishable.
func styleFor(i int, dashed bool) draw.LineStyle {
	sty := draw.LineStyle{Color: palette[i%len(palette)], Width: vg.Points(1.6)}
	if dashed || i >= len(palette) {
		sty.Dashes = []vg.Length{vg.Points(5), vg.Points(3)}
	}
	return sty
}

// refStyle is the style of the i-th reference line: dark grey, each with its own dash
// pattern so that two bounds can be told apart.
func refStyle(i int) draw.LineStyle {
	dashes := [][]vg.Length{
		{vg.Points(2), vg.Points(2)},
		{vg.Points(7), vg.Points(3)},
		{vg.Points(7), vg.Points(2), vg.Points(1.5), vg.Points(2)},
		{vg.Points(1), vg.Points(4)},
	}
	return draw.LineStyle{
		Color:  color.RGBA{0x44, 0x44, 0x44, 0xff},
		Width:  vg.Points(1.2),
		Dashes: dashes[i%len(dashes)],
	}
}

const (
	chartWidth  = 8 * vg.Inch
	chartHeight = 4.5 * vg.Inch
	pngDPI      = 144 // crisp on high-density screens, still small files
)

// sansFont is Liberation Sans (embedded in gonum/plot), metric-compatible with Arial and
// Helvetica, which the HTML page names as fallbacks for the inline SVG.
var sansFont = font.Font{Typeface: "Liberation", Variant: "Sans"}

// legendEntry is drawn by drawLegend outside the data area.
type legendEntry struct {
	name   string
	thumbs []plot.Thumbnailer
}

// build turns the chart into a gonum plot (without legend) and its legend entries.
// reserve is the width kept right of the data area for the legend.
func (c Chart) build(col colours, reserve vg.Length) (*plot.Plot, []legendEntry, error) {
	p := c.newPlot()
	var (
		legend []legendEntry
		err    error
	)
	if c.Bars {
		legend, err = c.addBars(p, col, reserve)
	} else {
		legend, err = c.addLines(p, col)
	}
	if err != nil {
		return nil, nil, err
	}
	for i, r := range c.Refs {
		ref := refLine{y: r.Y, style: refStyle(i)}
		p.Add(ref)
		legend = append(legend, legendEntry{r.Label, []plot.Thumbnailer{lineThumb(ref.style)}})
	}

	if c.YMax > c.YMin {
		p.Y.Min, p.Y.Max = c.YMin, c.YMax
	}
	if c.LogX {
		setLog(&p.X)
	}
	if c.LogY {
		setLog(&p.Y)
	}
	return p, legend, nil
}

// newPlot is an empty plot with the chart's title, axis labels, fonts, ticks and grid.
func (c Chart) newPlot() *plot.Plot {
	p := plot.New()
	p.Title.Text = c.Title
	p.Title.TextStyle.Font = font.From(sansFont, 14)
	p.Title.Padding = vg.Points(8)
	for _, a := range []*plot.Axis{&p.X, &p.Y} {
		a.Label.TextStyle.Font = font.From(sansFont, 11)
		a.Tick.Label.Font = font.From(sansFont, 9)
		a.Label.Padding = vg.Points(4)
	}
	p.X.Tick.Marker, p.Y.Tick.Marker = niceTicks{}, niceTicks{}
	p.X.Label.Text = c.XLabel
	p.Y.Label.Text = c.YLabel

	grid := plotter.NewGrid()
	grid.Horizontal.Color = color.Gray{0xdd}
	grid.Vertical.Color = color.Gray{0xdd}
	if c.Bars {
		grid.Vertical.Color = nil
	}
	p.Add(grid)
	return p
}

// addBars draws the series as grouped bars, one group per category, and names the
// categories on the x axis.
func (c Chart) addBars(p *plot.Plot, col colours, reserve vg.Length) ([]legendEntry, error) {
	nser := max(len(c.Series), 1)
	ncat := 0
	for _, s := range c.Series {
		ncat = max(ncat, len(s.Y))
	}
	ncat = max(ncat, len(c.Categories), 1)
	// Bar widths are in points, not data units: share 80 % of each category's slot of
	// the approximate data-area width among the series.
	slot := (chartWidth - reserve - 70) / vg.Length(ncat)
	w := max(slot*0.8/vg.Length(nser), vg.Points(0.5))
	var legend []legendEntry
	for k, s := range c.Series {
		vals := make(plotter.Values, ncat)
		copy(vals, s.Y)
		bars, err := plotter.NewBarChart(vals, w)
		if err != nil {
			return nil, fmt.Errorf("%w: %s: %w", ErrInvalidChart, c.Name, err)
		}
		sty := styleFor(col.index(s.key()), false)
		bars.Color = sty.Color
		bars.LineStyle.Width = 0
		bars.Offset = (vg.Length(k) - vg.Length(nser-1)/2) * w
		p.Add(bars)
		if s.YLo != nil {
			p.Add(whiskers{offset: bars.Offset, width: min(w*0.6, vg.Points(8)), lo: s.YLo, hi: s.YHi})
		}
		legend = append(legend, legendEntry{s.Name, []plot.Thumbnailer{bars}})
	}
	labels := make([]string, ncat)
	for i := range labels {
		if i < len(c.Categories) {
			labels[i] = c.Categories[i]
		} else {
			labels[i] = strconv.Itoa(i)
		}
	}
	p.NominalX(labels...)
	// Categories sit at 0…n−1; half a slot of margin each side makes the axis (and the
	// reference lines across it) span every group fully.
	p.X.Min, p.X.Max = -0.5, float64(ncat)-0.5
	return legend, nil
}

// addLines draws each series as a line over its X (a step function for a CDF), with its
// points marked when asked.
func (c Chart) addLines(p *plot.Plot, col colours) ([]legendEntry, error) {
	var legend []legendEntry
	for _, s := range c.Series {
		xys := make(plotter.XYs, len(s.X))
		for i := range s.X {
			xys[i] = plotter.XY{X: s.X[i], Y: s.Y[i]}
		}
		sty := styleFor(col.index(s.key()), s.Dashed)
		var thumbs []plot.Thumbnailer
		if len(xys) > 0 {
			line, err := plotter.NewLine(xys)
			if err != nil {
				return nil, fmt.Errorf("%w: %s: %w", ErrInvalidChart, c.Name, err)
			}
			line.LineStyle = sty
			if s.Step {
				line.StepStyle = plotter.PostStep
			}
			p.Add(line)
			thumbs = append(thumbs, line)
			if s.Points {
				sc, err := plotter.NewScatter(xys)
				if err != nil {
					return nil, fmt.Errorf("%w: %s: %w", ErrInvalidChart, c.Name, err)
				}
				sc.GlyphStyle = draw.GlyphStyle{Color: line.Color, Radius: vg.Points(2.5), Shape: draw.CircleGlyph{}}
				p.Add(sc)
				thumbs = append(thumbs, sc)
			}
		}
		if len(thumbs) == 0 {
			// An empty series still gets its legend entry, so a missing policy is visible.
			thumbs = append(thumbs, lineThumb(sty))
		}
		legend = append(legend, legendEntry{s.Name, thumbs})
	}
	return legend, nil
}

// setLog switches an axis to log scale. gonum widens an empty or one-value range by ±1,
// which can reach zero and make the log scale panic: widen by a factor instead.
func setLog(a *plot.Axis) {
	a.Scale, a.Tick.Marker = plot.LogScale{}, logTicks{}
	switch {
	case math.IsInf(a.Min, 0) || math.IsInf(a.Max, 0) || a.Min <= 0:
		a.Min, a.Max = 1, 10
	case a.Min == a.Max:
		a.Min, a.Max = a.Min/2, a.Max*2
	}
}

// whiskers draw an interval on each bar of a series, at the bar's offset (in points) from its
// category: a vertical line from lo to hi with a cap at each end, dark so that it shows on any
// bar colour.
type whiskers struct {
	offset, width vg.Length
	lo, hi        []float64
}

func (w whiskers) Plot(c draw.Canvas, p *plot.Plot) {
	tx, ty := p.Transforms(&c)
	sty := draw.LineStyle{Color: color.RGBA{0x22, 0x22, 0x22, 0xff}, Width: vg.Points(1.2)}
	for i := range w.lo {
		if math.IsNaN(w.lo[i]) {
			continue
		}
		x := tx(float64(i)) + w.offset
		y0, y1 := ty(w.lo[i]), ty(w.hi[i])
		for _, seg := range [][]vg.Point{
			{{X: x, Y: y0}, {X: x, Y: y1}},
			{{X: x - w.width/2, Y: y0}, {X: x + w.width/2, Y: y0}},
			{{X: x - w.width/2, Y: y1}, {X: x + w.width/2, Y: y1}},
		} {
			c.StrokeLines(sty, c.ClipLinesY(seg)...)
		}
	}
}

func (w whiskers) DataRange() (xmin, xmax, ymin, ymax float64) {
	xmin, xmax, ymin, ymax = math.Inf(1), math.Inf(-1), math.Inf(1), math.Inf(-1)
	for i := range w.lo {
		if !math.IsNaN(w.lo[i]) {
			ymin, ymax = min(ymin, w.lo[i]), max(ymax, w.hi[i])
		}
	}
	return xmin, xmax, ymin, ymax
}

// lineThumb is a legend thumbnail for a line style without data.
type lineThumb draw.LineStyle

func (l lineThumb) Thumbnail(c *draw.Canvas) {
	y := c.Center().Y
	c.StrokeLine2(draw.LineStyle(l), c.Min.X, y, c.Max.X, y)
}

// refLine is a horizontal line across the whole data area; it adds its y to the data range
// so that a bound above every series stays visible.
type refLine struct {
	y     float64
	style draw.LineStyle
}

func (r refLine) Plot(c draw.Canvas, p *plot.Plot) {
	_, ty := p.Transforms(&c)
	y := ty(r.y)
	c.StrokeLines(r.style, c.ClipLinesY([]vg.Point{{X: c.Min.X, Y: y}, {X: c.Max.X, Y: y}})...)
}

func (r refLine) DataRange() (xmin, xmax, ymin, ymax float64) {
	return math.Inf(1), math.Inf(-1), r.y, r.y
}

func (c Chart) legendNames() []string {
	var names []string
	for _, s := range c.Series {
		names = append(names, s.Name)
	}
	for _, r := range c.Refs {
		names = append(names, r.Label)
	}
	return names
}

// niceTicks places labelled ticks at multiples of a "nice" step (1, 2 or 5 × 10^k) giving
// about five to ten labels (Heckbert's nice-numbers labelling), with a minor tick halfway,
// and labels with just the decimals the step needs. gonum's DefaultTicks labels every tick
// with the precision of the finest one ("0.00", "25.00") and may pick odd steps (1, 5, 9).
type niceTicks struct{}

func (niceTicks) Ticks(lo, hi float64) []plot.Tick {
	if !(hi > lo) || math.IsInf(lo, 0) || math.IsInf(hi, 0) {
		return []plot.Tick{{Value: lo, Label: strconv.FormatFloat(lo, 'g', 4, 64)}}
	}
	step := niceStep((hi - lo) / 6)
	dec := max(0, -int(math.Floor(math.Log10(step)+1e-9)))
	var ticks []plot.Tick
	for k := math.Ceil(lo/step - 1e-9); k*step <= hi+step*1e-9; k++ {
		v := k * step
		label := strconv.FormatFloat(v, 'f', dec, 64)
		if v == 0 {
			label = strconv.FormatFloat(0, 'f', dec, 64) // never "-0"
		}
		ticks = append(ticks, plot.Tick{Value: v, Label: label})
		if half := v + step/2; half <= hi {
			ticks = append(ticks, plot.Tick{Value: half})
		}
	}
	if first := math.Ceil(lo/step-1e-9) * step; first-step/2 >= lo {
		ticks = append(ticks, plot.Tick{Value: first - step/2})
	}
	return ticks
}

// niceStep rounds raw up to 1, 2 or 5 × 10^k.
func niceStep(raw float64) float64 {
	e := math.Pow(10, math.Floor(math.Log10(raw)))
	switch f := raw / e; {
	case f <= 1:
		return e
	case f <= 2:
		return 2 * e
	case f <= 5:
		return 5 * e
	default:
		return 10 * e
	}
}

// logTicks labels 1, 2 and 5 × 10^k inside the range, with minor ticks at the other
// integer multiples. gonum's LogTicks labels only powers of ten, which leaves a range such
// as 40–400 ms without a single label.
type logTicks struct{}

func (logTicks) Ticks(lo, hi float64) []plot.Tick {
	if lo <= 0 || hi <= 0 || hi < lo {
		return nil
	}
	var ticks []plot.Tick
	for e := math.Floor(math.Log10(lo)); e <= math.Ceil(math.Log10(hi)); e++ {
		base := math.Pow(10, e)
		for m := 1; m <= 9; m++ {
			v := float64(m) * base
			if v < lo*(1-1e-9) || v > hi*(1+1e-9) {
				continue
			}
			t := plot.Tick{Value: v}
			if m == 1 || m == 2 || m == 5 {
				t.Label = strconv.FormatFloat(v, 'g', -1, 64)
			}
			ticks = append(ticks, t)
		}
	}
	return ticks
}

// render draws the chart in format "svg" or "png".
func (c Chart) render(col colours, format string) ([]byte, error) {
	if err := c.validate(); err != nil {
		return nil, err
	}
	leg := plot.NewLegend()
	leg.Top, leg.Left = true, true
	leg.TextStyle.Font = font.From(sansFont, 9)
	leg.ThumbnailWidth = vg.Points(22)
	leg.Padding = vg.Points(2)
	// The legend sits right of the data area, as wide as its longest entry, so that it never
	// hides a curve.
	pad := vg.Points(8)
	reserve := vg.Points(60)
	for _, name := range c.legendNames() {
		reserve = max(reserve, leg.ThumbnailWidth+leg.TextStyle.Width(" "+name)+2*pad)
	}
	reserve = min(reserve, chartWidth/2)

	p, legend, err := c.build(col, reserve)
	if err != nil {
		return nil, err
	}
	for _, e := range legend {
		leg.Add(e.name, e.thumbs...)
	}
	// Grow the canvas rather than let a long legend (15 policies) run off the bottom.
	h := chartHeight
	if need := leg.Rectangle(draw.Canvas{}).Size().Y + vg.Points(40); need > h {
		h = need
	}

	var cw vg.CanvasWriterTo
	switch format {
	case "svg":
		cw = vgsvg.New(chartWidth, h)
	case "png":
		cw = vgimg.PngCanvas{Canvas: vgimg.NewWith(vgimg.UseWH(chartWidth, h), vgimg.UseDPI(pngDPI))}
	default:
		return nil, fmt.Errorf("%w: format %q", ErrInvalidChart, format)
	}
	dc := draw.New(cw)
	// A white background under the legend too (the plot only paints its own area).
	dc.SetColor(color.White)
	dc.Fill(dc.Rectangle.Path())

	p.Draw(draw.Crop(dc, 0, -reserve, 0, 0))
	leg.Draw(draw.Crop(dc, chartWidth-reserve+pad, -pad, pad, -vg.Points(30)))

	var buf bytes.Buffer
	if _, err := cw.WriteTo(&buf); err != nil {
		return nil, fmt.Errorf("report: render %s.%s: %w", c.Name, format, err)
	}
	return buf.Bytes(), nil
}
