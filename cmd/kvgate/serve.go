package main

// runServe is replaced by the serve verb when it is built.
var runServe = notBuilt("serve")
