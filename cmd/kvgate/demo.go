package main

// runDemo is replaced by the demo verb when it is built.
var runDemo = notBuilt("demo")
