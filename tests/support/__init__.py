"""What the tests share: real services, Ray heads and CLI processes to test against, spawned
process groups, small models and data, fakes at the service's seams, waits. Test modules
import from here, never from one another."""
